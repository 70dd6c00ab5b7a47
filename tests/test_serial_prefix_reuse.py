"""Prefix reuse one sequence at a time (``SpeculativeDecoder(reuse_prefix=True)``, the
engine's ``generate`` / ``stream`` and ``serve --max-batch-size 1``): the caches keep the
last request's rows (target K/V, drafter context, the last verify's features not yet
injected) and a prompt that starts with its tokens reads only the rest. Every turn decodes
exactly as with reuse off (tokens and acceptance lengths, greedy and seeded sampling; float32),
eager, fixed shapes, recompute and target-only, on attention, DFlash 2, mixture-of-experts,
hybrid and sliding-window (ring) models; the count of reused rows is exact."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import varied_prompts, serve_in_thread
from test_batch import agree_models, hybrid_models, qwen35_models, ring_models  # noqa: F401 (fixtures)
from test_server import MODEL

from dflash_torch import DFlashEngine, DFlashError, SamplingParams, decoding
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.serving.app import create_app

C = 16  # prefill chunk: prompts here read in several chunks, and a reused prefix ends inside one
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=17)
MORE = [7, 8, 9, 10]  # a user's next message


def turn(decoder: SpeculativeDecoder, prompt: list[int], budget: int, params: SamplingParams = GREEDY, **kw):
    """Decode ``prompt`` until ``budget`` tokens are committed -> (every token committed, the
    rounds' acceptance lengths, the prompt tokens reused, the prompt's rows afterwards
    (:func:`prompt_rows`; None where rings keep only the last positions))."""
    tokens, taus, reused = [], [], None
    for rnd in decoder.rounds(prompt, params, budget, **kw):
        if rnd.acceptance_length is None:
            reused = rnd.cached_tokens
        else:
            taus.append(rnd.acceptance_length)
        tokens += rnd.tokens
    rings = decoder.target_cache.kv.rings + getattr(getattr(decoder.context, "cache", None), "rings", [])
    return tokens, taus, reused, None if any(rings) else prompt_rows(decoder, len(prompt))


def same_turns(on: list, off: list) -> None:
    """The same tokens and acceptance lengths with reuse on and off, and the same prompt rows
    (up to float rounding: reused rows were computed by verify blocks and injections, read ones
    by prefill chunks; wrong drafter context rows need not change this pair's drafts)."""
    assert [o[:2] for o in on] == [o[:2] for o in off]
    for k, (a, b) in enumerate(zip(on, off)):
        if a[3] is not None:
            torch.testing.assert_close(a[3], b[3], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"turn {k}: {m}")


def prompt_rows(decoder: SpeculativeDecoder, n: int) -> torch.Tensor:
    """The target K/V and drafter context rows of positions ``[0, n)`` (no rings here), flattened."""
    parts = [t[:, :n] for t in decoder.target_cache.kv.k + decoder.target_cache.kv.v]
    context = decoder.context
    if isinstance(context, decoding.InjectedContext):
        parts += [t[:, :n] for t in context.cache.k + context.cache.v]
    elif context is not None:
        parts.append(torch.cat(context.features)[:n])
    return torch.cat([t.float().flatten() for t in parts])


def decoders(target, drafter, mode: str, **kw) -> dict[bool, SpeculativeDecoder]:
    """A decoder with prefix reuse and one without, in ``mode``."""
    opts = dict(max_context=512, prefill_chunk=C, static=mode == "static",
                draft_mode="recompute" if mode == "recompute" else "inject", **kw)
    return {reuse: SpeculativeDecoder(target, None if mode == "target-only" else drafter, reuse_prefix=reuse, **opts)
            for reuse in (True, False)}


CASES = [("agree_models", "eager"), ("agree_models", "static"), ("agree_models", "recompute"),
         ("agree_models", "target-only"), ("dflash2_models", "eager"), ("moe_models", "eager"), ("moe_models", "static")]


@pytest.mark.parametrize("models,mode", CASES, ids=[f"{m.split('_')[0]}-{mode}" for m, mode in CASES])
def test_each_turn_reuses_the_last_requests_rows(request, models, mode):
    """Turn 1 keeps 20 tokens of turn 0's reply (a stop string): it reuses turn 0's prompt and
    those tokens; turn 2 holds turn 1's whole reply: it reuses every row (all but the last
    token committed); turn 3 diverges inside the first prompt; turn 4 is turn 3 again (nothing
    read: its last logits are kept); turn 5 grows past the eager caches' first allocation (256
    positions: the rows are copied into the larger buffers). Every turn (a sampled one too)
    decodes as with reuse off; greedy turns as target-only decoding."""
    target, drafter = request.getfixturevalue(models)
    runs = {reuse: [] for reuse in (True, False)}
    for reuse, decoder in decoders(target, drafter, mode).items():
        outs, prompts = runs[reuse], [varied_prompts(target, 1, seed=41, length=2 * C + 3)[0]]
        outs.append(turn(decoder, prompts[0], 30))
        prompts.append(prompts[0] + outs[0][0][:20] + MORE)
        outs.append(turn(decoder, prompts[1], 25, SAMPLED))
        prompts.append(prompts[1] + outs[1][0] + MORE)
        outs.append(turn(decoder, prompts[2], 15))
        prompts += [prompts[0][:7] + MORE] * 2
        outs += [turn(decoder, prompts[3], 12), turn(decoder, prompts[4], 12)]
        prompts.append(prompts[4] + outs[4][0] + varied_prompts(target, 1, seed=5, length=280)[0])
        outs.append(turn(decoder, prompts[5], 10))
    on, off = runs[True], runs[False]
    same_turns(on, off)
    assert [o[2] for o in off] == [0] * 6
    n = [len(p) for p in prompts]
    assert [o[2] for o in on] == [0, n[0] + 20, n[1] + len(on[1][0]) - 1, 7, n[4], n[4] + len(on[4][0]) - 1]
    assert n[5] > 256 + 15
    if mode == "eager":
        alone = SpeculativeDecoder(target, None, max_context=512)
        for k in (0, 2, 3, 5):
            assert on[k][0][:10] == turn(alone, prompts[k], 10)[0][:10], k


def test_a_prompt_inside_the_last_requests_rows_reads_its_last_token(agree_models):  # noqa: F811 (the imported fixture)
    """A prompt that the caches' rows hold whole but that is not the last prompt (the last
    prompt and the start of its reply; the last prompt cut short) reuses all its tokens but
    the last, which it reads for its logits: it decodes as with reuse off."""
    target, drafter = agree_models
    runs = {}
    for reuse, decoder in decoders(target, drafter, "eager").items():
        p0 = varied_prompts(target, 1, seed=41, length=2 * C + 3)[0]
        first = turn(decoder, p0, 20)
        grown = p0 + first[0][:5]
        runs[reuse] = [first[:3], turn(decoder, grown, 12)[:3], turn(decoder, p0[:-3], 12)[:3]]
    assert [r[:2] for r in runs[True]] == [r[:2] for r in runs[False]]
    assert [r[2] for r in runs[True]] == [0, 2 * C + 3 + 5 - 1, 2 * C + 3 - 3 - 1]


HYBRID = [("hybrid_models", "eager"), ("qwen35_models", "eager"), ("qwen35_models", "static"), ("ring_models", "eager"),
          ("ring_models", "static")]


@pytest.mark.parametrize("models,mode", HYBRID, ids=[f"{m.split('_')[0]}-{mode}" for m, mode in HYBRID])
def test_hybrid_and_ring_models_reuse_all_rows_or_the_last_prompt(request, models, mode):
    """A recurrent state (a ring: the last positions written) is known at the end of the
    kept rows and, from its copy, at the end of the prompt they began with: a prompt that
    extends all the rows reuses them; one that diverges inside the reply reuses that prompt
    (the copy is restored); one that diverges inside it is read whole; the same prompt again
    reads nothing (the copy and its last logits). (The ring models' first reply is longer
    than the rings' slack, so only the copy has the prompt's rings.)"""
    target, drafter = request.getfixturevalue(models)
    first = 100 if models == "ring_models" else 20
    runs = {reuse: [] for reuse in (True, False)}
    for reuse, decoder in decoders(target, drafter, mode).items():
        outs, prompts = runs[reuse], [varied_prompts(target, 1, seed=43, length=C + 5)[0]]
        outs.append(turn(decoder, prompts[0], first))
        prompts.append(prompts[0] + outs[0][0] + MORE)  # extends every row
        outs.append(turn(decoder, prompts[1], 20, SAMPLED))
        prompts.append(prompts[1] + outs[1][0][:2] + MORE)  # diverges inside the reply
        outs.append(turn(decoder, prompts[2], 20))
        prompts.append(prompts[2][:5] + MORE)  # diverges inside the prompt
        outs.append(turn(decoder, prompts[3], 15))
        prompts.append(prompts[3])  # the same prompt again: its copies and last logits
        outs.append(turn(decoder, prompts[4], 15, SAMPLED))
    on, off = runs[True], runs[False]
    same_turns(on, off)
    n = [len(p) for p in prompts]
    assert [o[2] for o in on] == [0, n[0] + len(on[0][0]) - 1, n[1], 0, n[4]]


def test_a_run_left_early_or_taken_over_keeps_its_rows(agree_models):  # noqa: F811 (the imported fixture)
    """A run closed after two rounds (a stop string) and one a later ``rounds()`` call takes
    over keep the rows of their last round, the drafter's context too (its last verify's
    features were still pending): the next prompt that holds them reuses them and decodes as
    a decoder without reuse."""
    target, drafter = agree_models
    dec, fresh = (SpeculativeDecoder(target, drafter, prefill_chunk=C, reuse_prefix=r) for r in (True, False))
    prompt = varied_prompts(target, 1, seed=44, length=C + 9)[0]
    run = dec.rounds(prompt, GREEDY, 200)
    tokens = [t for _, rnd in zip(range(3), run) for t in rnd.tokens]
    run.close()
    nxt = prompt + tokens + MORE
    got = turn(dec, nxt, 20)
    assert got[2] == len(prompt) + len(tokens) - 1
    same_turns([got], [turn(fresh, nxt, 20)])
    suspended = dec.rounds(nxt, GREEDY, 200)
    tokens = [t for _, rnd in zip(range(2), suspended) for t in rnd.tokens]
    after = nxt + tokens + MORE
    got = turn(dec, after, 20)  # (takes the caches over from the suspended run)
    assert got[2] == len(nxt) + len(tokens) - 1
    same_turns([got], [turn(fresh, after, 20)])
    with pytest.raises(decoding.DFlashError, match="took over its caches"):
        next(suspended)


@pytest.mark.parametrize("models", ["agree_models", "qwen35_models"], ids=["attention", "qwen35-hybrid"])
def test_a_round_that_fails_midway(request, models, monkeypatch):
    """A failure inside a round (after its verify wrote the caches; Ctrl-C in ``chat``) leaves
    the rows of the last round that ended: an attention target reuses them (the round wrote
    none before them but the pending context rows, with the same values); a hybrid target's
    recurrent state may have moved, so its next prompt is read whole. Both decode as without reuse."""
    target, drafter = request.getfixturevalue(models)
    dec, fresh = (SpeculativeDecoder(target, drafter, prefill_chunk=C, reuse_prefix=r) for r in (True, False))
    prompt = varied_prompts(target, 1, seed=45, length=C + 3)[0]
    calls, accept, committed = [], decoding.accept_greedy, []

    def failing_third(*args):
        calls.append(None)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return accept(*args)

    monkeypatch.setattr(decoding, "accept_greedy", failing_third)
    with pytest.raises(RuntimeError, match="^injected failure$"):
        for rnd in dec.rounds(prompt, GREEDY, 200):
            committed += rnd.tokens
    monkeypatch.undo()
    nxt = prompt + committed + MORE
    got = turn(dec, nxt, 20)
    assert got[2] == (0 if models == "qwen35_models" else len(prompt) + len(committed) - 1)
    same_turns([got], [turn(fresh, nxt, 20)])


def test_prompt_logprobs_read_the_whole_prompt(agree_models):  # noqa: F811 (the imported fixture)
    """A request for prompt logprobs scores every prompt token, so it reuses nothing (its
    logprobs are those without reuse); the next turn reuses its rows."""
    target, drafter = agree_models
    dec, fresh = (SpeculativeDecoder(target, drafter, prefill_chunk=C, reuse_prefix=r) for r in (True, False))
    prompt = varied_prompts(target, 1, seed=46, length=C + 3)[0]
    first = turn(dec, prompt, 12)
    again = prompt + first[0] + MORE
    scored = [next(d.rounds(again, GREEDY, 12, prompt_logprobs=2)) for d in (dec, fresh)]
    assert scored[0].cached_tokens == 0
    assert scored[0].prompt_logprobs[1:] == scored[1].prompt_logprobs[1:] and len(scored[0].prompt_logprobs) == len(again)
    assert turn(dec, again + MORE, 10)[2] == len(again)  # (the scored run kept its prompt's rows)


def test_engine_turns_and_one_slot_server_reuse_the_last_request(tiny_pair):
    """``DFlashEngine.generate`` (reuse on by default) reports the reused rows in
    ``stats.cached_prompt_tokens`` and gives reuse off's tokens; a one-slot server
    (``max_batch_size=1``, as ``serve --max-batch-size 1``: one sequence at a time; real
    uvicorn in a thread of this process) reports them in
    ``usage.prompt_tokens_details.cached_tokens`` and counts them in ``/metrics``."""
    engines = {reuse: DFlashEngine.from_pretrained(*tiny_pair, reuse_prefix=reuse, max_context=512)
               for reuse in (True, False)}
    prompt = "def fibonacci(n):"
    outs = {}
    for reuse, engine in engines.items():
        first = engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        second = engine.generate(prompt + first.text + "\n\ndef main():", max_new_tokens=24, ignore_eos=True)
        outs[reuse] = first, second
    (first, second), (first_off, second_off) = outs[True], outs[False]
    assert (first.token_ids, second.token_ids) == (first_off.token_ids, second_off.token_ids)
    assert first.stats.cached_prompt_tokens == 0 and second_off.stats.cached_prompt_tokens == 0
    n = len(engines[True].encode_prompt(prompt))
    assert second.stats.cached_prompt_tokens >= n  # (the reply's tokens too, as far as they tokenize the same)
    again = [engines[True].generate(prompt, max_new_tokens=8, logprobs=2) for _ in range(2)]
    assert again[1].stats.cached_prompt_tokens == n and again[0].logprobs == again[1].logprobs  # (bit for bit)

    app = create_app(DFlashEngine.from_pretrained(*tiny_pair), model_name=MODEL, max_batch_size=1)
    with serve_in_thread(app) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        r1 = client.completions.create(prompt=prompt, **kw)
        r2 = client.completions.create(prompt=prompt + r1.choices[0].text + "\n\ndef main():", **kw)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert cached == second.stats.cached_prompt_tokens and r2.choices[0].text == second.text
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert f"dflash_reused_prefill_tokens_total {float(cached)}" in metrics
        assert f"dflash_prefill_tokens_total {float(r1.usage.prompt_tokens + r2.usage.prompt_tokens - cached)}" in metrics


def test_reuse_keeps_no_more_state_than_needed(agree_models, qwen35_models):  # noqa: F811 (the imported fixtures)
    """Attention-only models keep no copies; a hybrid keeps one of its recurrent states (not of
    the K/V rows): the memory prefix reuse costs one sequence at a time."""
    for (target, drafter), copies in ((agree_models, 0), (qwen35_models, None)):
        dec = SpeculativeDecoder(target, drafter, prefill_chunk=C, reuse_prefix=True)
        turn(dec, varied_prompts(target, 1, seed=47, length=C + 3)[0], 8)
        saved = dec._kept.saved
        if copies == 0:
            assert saved is None
        else:
            state = dec.target_cache.recurrent
            assert len(saved) == len(state.conv) + len(state.ssm)
            assert [t.shape for t in saved] == [t.shape for t in state.conv + state.ssm]


def test_compiled_turns_build_no_graph_after_warmup(agree_models):  # noqa: F811 (the imported fixture)
    """Compiled (the "eager" backend: TorchDynamo's guards decide recompilation): after
    ``warmup()``, turns that reuse rows (a prefill starting inside a chunk, or none at all for
    the same prompt again) build no graph and decode as without reuse."""
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    target, drafter = agree_models
    runs = {}
    for reuse in (True, False):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        dec = SpeculativeDecoder(target, drafter, max_context=200, prefill_chunk=32, compile=True,
                                 compile_backend="eager", reuse_prefix=reuse)
        dec.warmup(200)
        graphs, frames = dynamo_utils.counters["stats"]["unique_graphs"], dynamo_utils.counters["frames"]["total"]
        outs, p0 = [], varied_prompts(target, 1, seed=48, length=C + 5)[0]
        outs.append(turn(dec, p0, 20))
        p1 = p0 + outs[0][0][:20] + MORE
        outs.append(turn(dec, p1, 30, SAMPLED))
        outs += [turn(dec, p1, 30, SAMPLED), turn(dec, p1 + outs[1][0] + p0 * 3, 20)]
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was built after warm-up"
        assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"
        runs[reuse] = outs, [len(p0), len(p1)]
    (on, n), (off, _) = runs[True], runs[False]
    assert [o[:2] for o in on] == [o[:2] for o in off]
    assert [o[2] for o in on] == [0, n[0] + min(20, len(on[0][0]) - 1), n[1], n[1] + len(on[2][0]) - 1]


def test_reuse_prefix_must_be_a_bool(agree_models):  # noqa: F811 (the imported fixture)
    target, drafter = agree_models
    for bad in ("no", 1, None):
        with pytest.raises(decoding.OptionError, match=rf"^reuse_prefix must be True or False, got {bad!r}$"):
            SpeculativeDecoder(target, drafter, reuse_prefix=bad)


CHECKPOINTED = [("hybrid_models", "eager"), ("qwen35_models", "static"), ("ring_models", "eager")]


@pytest.mark.parametrize("models,mode", CHECKPOINTED, ids=[f"{m.split('_')[0]}-{mode}" for m, mode in CHECKPOINTED])
def test_a_checkpoint_inside_the_prompt_keeps_the_copies_there(request, models, mode):
    """``rounds(checkpoint=c)``: a hybrid (ring) model's copies are taken at position c of
    the prompt (a chat's messages before the template's opening of the reply), so a next
    prompt that starts with the first c tokens but not with the whole prompt (a template that
    renders the reply otherwise) reuses c of them (it reused none with copies at the prompt's
    end); the same prompt again restores them there and reads the rest; every turn decodes
    as without reuse. A checkpoint outside the prompt is refused."""
    target, drafter = request.getfixturevalue(models)
    runs = {reuse: [] for reuse in (True, False)}
    for reuse, decoder in decoders(target, drafter, mode).items():
        outs, prompts = runs[reuse], [varied_prompts(target, 1, seed=51, length=C + 9)[0]]
        outs.append(turn(decoder, prompts[0], 20, checkpoint=len(prompts[0]) - 3))
        prompts.append(prompts[0][:-3] + MORE + outs[0][0][2:9] + MORE)  # (the reply rendered otherwise)
        outs.append(turn(decoder, prompts[1], 20, SAMPLED, checkpoint=len(prompts[1]) - 3))
        outs.append(turn(decoder, prompts[1], 20, checkpoint=len(prompts[1]) - 3))  # the same prompt again
        outs.append(turn(decoder, prompts[1][:-3] + [3, 4], 12, checkpoint=len(prompts[1]) - 3))  # (at the copy)
    on, off = runs[True], runs[False]
    same_turns(on, off)
    n = [len(p) for p in prompts]
    assert [o[2] for o in on] == [0, n[0] - 3, n[1] - 3, n[1] - 3] and [o[2] for o in off] == [0] * 4
    decoder = decoders(target, drafter, mode)[True]
    for bad in (0, n[0] + 1, True, 2.0):
        with pytest.raises(decoding.DFlashError, match=rf"^checkpoint must be None or a position in \(0, {n[0]}\], "
                                                       rf"got {bad!r}$"):
            decoder.rounds(prompts[0], GREEDY, 4, checkpoint=bad)


def test_hybrid_chat_turns_reuse_the_last_messages(agree_hybrid_pair):
    """Through the engine: a chat (messages) on a hybrid target whose template renders a past
    reply otherwise than its opening of the reply (this tokenizer's: "# assistant:\\n" then
    "# assistant: text"): each turn reuses the rows of the last turn's messages (the
    checkpoint the engine gives, where the template's rendering without the opening ends),
    and decodes as reuse off."""
    engines = {reuse: DFlashEngine.from_pretrained(*agree_hybrid_pair, dtype="float32", reuse_prefix=reuse)
               for reuse in (True, False)}
    outs, history = {}, []
    for reuse, engine in engines.items():
        messages, outs[reuse] = [{"role": "system", "content": "be brief"}], []
        for text in ("def f(x):", "class A:", "import os"):
            messages.append({"role": "user", "content": text})
            r = engine.generate(messages, chat=True, max_new_tokens=12)
            if reuse:
                history.append(len(engine.encode_prompt(messages, add_generation_prompt=False)))
            messages.append({"role": "assistant", "content": r.text})
            outs[reuse].append((r.token_ids, r.stats.cached_prompt_tokens))
    assert [o[0] for o in outs[True]] == [o[0] for o in outs[False]]
    assert [o[1] for o in outs[True]] == [0, history[0], history[1]] and history[0] > 10
    assert [o[1] for o in outs[False]] == [0, 0, 0]


LONG_SYSTEM = ("You review Python code. Answer with code only, no prose; keep every name the user gave, "
               "prefer the standard library, and never print secrets, tokens or keys. " * 2)


def test_hybrid_chat_turns_reuse_the_last_messages_in_batches_and_behind_the_server(agree_hybrid_pair):
    """The chat of :func:`test_hybrid_chat_turns_reuse_the_last_messages` through
    ``generate_batch`` (the batch decoder: join's ``checkpoint``), and through a server
    (batched, and one sequence at a time: ``history_end`` of ``engine.stream``; real uvicorn
    in a thread of this process) with the openai client: each turn reuses the last turn's messages (``usage.prompt_tokens_details
    .cached_tokens``), and gives the engine's reply. Then two conversations with the same
    long system message and different user messages: through the batch decoder (join's
    ``shared_end``, :meth:`DFlashEngine.shared_end`), the second reads only what follows
    the system message (its snapshot of the hybrid state there); one sequence at a time it
    reads it all (the last request's state is known at its own positions only); every reply
    is the engine's."""
    engine = DFlashEngine.from_pretrained(*agree_hybrid_pair, dtype="float32")
    texts = ("def f(x):", "class A:", "import os")
    others = [[{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": text}] for text in texts[:2]]
    shared = engine.shared_end(others[1], engine.encode_prompt(others[1]))
    system_tokens = len(engine.encode_prompt(others[1][:1], add_generation_prompt=False))
    assert shared == engine.shared_end(others[0], engine.encode_prompt(others[0])) and 64 <= shared <= system_tokens

    def chat(reply):
        messages, out = [{"role": "system", "content": "be brief"}], []
        for text in texts:
            messages.append({"role": "user", "content": text})
            history = len(engine.encode_prompt(messages, add_generation_prompt=False))
            content, cached = reply(messages)
            messages.append({"role": "assistant", "content": content})
            out.append((content, cached, history))
        return out

    def batch(messages):
        r = engine.generate_batch([messages], chat=True, max_new_tokens=12)[0]
        return r.text, r.stats.cached_prompt_tokens

    alone = chat(lambda m: (engine.generate(m, chat=True, max_new_tokens=12).text, None))
    alone_others = [engine.generate(m, chat=True, max_new_tokens=12).text for m in others]
    turns = chat(batch)
    assert [t[0] for t in turns] == [t[0] for t in alone]
    assert [t[1] for t in turns] == [0, turns[0][2], turns[1][2]] and turns[0][2] > 10
    assert [batch(m) for m in others] == [(alone_others[0], 0), (alone_others[1], shared)]
    for slots in (None, 1):  # (None: the batched backend)
        app = create_app(DFlashEngine.from_pretrained(*agree_hybrid_pair, dtype="float32"), model_name=MODEL,
                         max_batch_size=slots)
        with serve_in_thread(app) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none")

            def served(messages):
                r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
                return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

            got = chat(served)
            got_others = [served(m) for m in others]
        assert got == turns, slots
        assert got_others == [(alone_others[0], 0), (alone_others[1], 0 if slots else shared)], slots


def test_history_end_of_token_id_prompts(agree_hybrid_pair, tiny_pair, tmp_path):
    """``DFlashEngine.history_end`` gives where a chat's messages end in its token ids (on a
    model that keeps copies, with a template that renders the reply otherwise in the next
    turn; None where the next turn renders the whole prompt again, on an attention model, and
    for a plain text); ``stream`` / ``generate`` take it with a token-id prompt (the next turn
    then reuses the history as a chat given as messages does) and refuse anything but a
    position in the prompt."""
    import shutil

    engine = DFlashEngine.from_pretrained(*agree_hybrid_pair, dtype="float32")
    messages = [{"role": "user", "content": "def f(x):"}]
    ids = engine.encode_prompt(messages)
    end = engine.history_end(messages, ids)
    assert end == len(engine.encode_prompt(messages, add_generation_prompt=False)) < len(ids)
    assert engine.history_end("def f(x):", engine.encode_prompt("def f(x):")) is None
    for bad in (0, len(ids) + 1, -1, True, 2.5, "3"):
        with pytest.raises(DFlashError, match=rf"^history_end must be None or a position in the prompt's {len(ids)} "):
            engine.generate(ids, max_new_tokens=2, history_end=bad)
    reply = engine.generate(ids, max_new_tokens=12, history_end=end)
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "class A:"}]
    ids = engine.encode_prompt(messages)
    second = engine.generate(ids, max_new_tokens=12, history_end=engine.history_end(messages, ids))
    assert second.stats.cached_prompt_tokens == end
    assert second.token_ids == engine.generate(messages, max_new_tokens=12).token_ids
    attention = DFlashEngine.from_pretrained(*tiny_pair, max_context=256)
    assert attention.history_end(messages, attention.encode_prompt(messages)) is None
    # (shared_end: a chat's leading system messages of at least SHARED_START_MIN tokens, on a hybrid or ring model)
    long = [{"role": "system", "content": LONG_SYSTEM}] + messages
    assert attention.shared_end(long, attention.encode_prompt(long)) is None
    hybrid = DFlashEngine.from_pretrained(*agree_hybrid_pair, dtype="float32")
    assert hybrid.shared_end(long, hybrid.encode_prompt(long)) >= 64
    for no_start in ([{"role": "system", "content": "be brief"}] + messages, messages):
        assert hybrid.shared_end(no_start, hybrid.encode_prompt(no_start)) is None, no_start
    assert hybrid.shared_end("some text", hybrid.encode_prompt("some text")) is None
    chatml = shutil.copytree(agree_hybrid_pair[0], tmp_path / "target")  # (its opening of the reply starts a past reply)
    (chatml / "chat_template.jinja").write_text("{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n"
                                                "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}")
    engine = DFlashEngine.from_pretrained(chatml, agree_hybrid_pair[1], dtype="float32")
    assert engine.history_end(messages, engine.encode_prompt(messages)) is None
    # (a message's last token merges with the opening of the reply, as the shipped target's newline with a newline
    # in its tokenizer, here "\n" with "   " of "    > ": the copy is taken before that token, where the next turn's
    # prompt still agrees: trial-232)
    (chatml / "chat_template.jinja").write_text("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n"
                                                "{% endfor %}{% if add_generation_prompt %}    > {% endif %}")
    engine = DFlashEngine.from_pretrained(chatml, agree_hybrid_pair[1], dtype="float32")
    messages = messages[:1]
    ids, history = engine.encode_prompt(messages), engine.encode_prompt(messages, add_generation_prompt=False)
    n = len(history) - 1
    assert ids[:n] == history[:n] and ids[n] != history[n]  # (the merge)
    end = engine.history_end(messages, ids)
    assert end == n
    reply = engine.generate(ids, max_new_tokens=12, history_end=end)
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "class A:"}]
    ids = engine.encode_prompt(messages)
    second = engine.generate(ids, max_new_tokens=12, history_end=engine.history_end(messages, ids))
    assert second.stats.cached_prompt_tokens == end
    assert second.token_ids == engine.generate(ids, max_new_tokens=12, history_end=None).token_ids


# the shipped target's chat template before its replies rendered as generated: "# assistant: " then the reply
REPLY_OTHERWISE = ("{% for message in messages %}{{ '# ' + message['role'] + ': ' + message['content'] + '\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '\\n' }}{% endif %}")


@pytest.mark.parametrize("template", ["reply otherwise", "shipped"])
def test_chat_turns_reuse_the_history_with_the_shipped_tokenizer_on_a_hybrid_target(tmp_path, template):
    """A hybrid target with the shipped target's tokenizer. With a template whose generation
    prompt is "\\n" but whose past replies render as "# assistant: ..." (the shipped one's
    before): a message ends with "\\n" and the reply opens with "\\n", one "\\n\\n" token in
    the prompt, and a message that ends with a newline itself renders its end otherwise in the
    next turn ("\\n\\n" then "\\n", "\\n", "#"): ``history_end`` is where the next turn's prompt
    still agrees, so turn 2 reuses the history, one sequence at a time and batched (trial-232
    and trial-235: both read their whole prompt again). The shipped template, which renders a
    past reply after a blank line as it was generated, has the same end where the message ends
    without a newline (the "\\n\\n" token that closes the prompt does not start the next turn,
    where the blank line merges with the reply's first characters); where it ends with one, the
    next turn renders the whole prompt again (no history end: None), which turn 2 reuses whole.
    Either way with the tokens decoded without reuse."""
    import shutil

    from conftest import make_hybrid_target

    from dflash_torch.engine import DEFAULT_TARGET

    target = make_hybrid_target(tmp_path / "target", "qwen3_5_text", tokenizer=False, vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_TARGET / name, target / name)
    if template == "reply otherwise":
        (target / "chat_template.jinja").write_text(REPLY_OTHERWISE)
    engines = [DFlashEngine.from_pretrained(target, no_draft=True, dtype="float32", max_batch_size=2,
                                            reuse_prefix=reuse) for reuse in (True, False)]
    for content in ("Tell me about lists.", "Tell me about lists.\n", "Tell me about lists. \n"):
        first = [{"role": "user", "content": content}]
        for batched in (False, True):
            outs = []
            for engine in engines:
                run = (lambda m: engine.generate_batch([m], max_new_tokens=6)[0]) if batched else \
                    (lambda m: engine.generate(m, max_new_tokens=6))
                one = run(first)
                then = first + [{"role": "assistant", "content": one.text}, {"role": "user", "content": "ok"}]
                two = run(then)
                outs.append((one.token_ids, two.token_ids, two.stats.cached_prompt_tokens))
            (a1, a2, cached), (b1, b2, none) = outs
            assert (a1, a2) == (b1, b2) and none == 0
            ids = engines[0].encode_prompt(first)
            end = engines[0].history_end(first, ids)
            if end is None:  # (the next turn renders the whole prompt again: its end serves)
                assert template == "shipped" and content.endswith("\n") and cached == len(ids), (content, cached)
            else:
                assert cached == end >= len(ids) - 2, (content, batched, cached, end, len(ids))
