"""Choices that share a prompt share its prefill (dflash_torch.batch, ``share_prefill``):
sequences joining with the prompt of one still joining (the ``n`` choices of a request)
wait for that one prefill, get a copy of its slot (target K/V rows, drafter context rows,
recurrent state) and sample their own first token; each decodes exactly as with a
prefill of its own (tokens and acceptance lengths, greedy and seeded sampling) on
attention, hybrid (Qwen3.5, Qwen3-Next), mixture-of-experts targets, DFlash and DFlash 2
drafters, eager, fixed shapes and compiled, while others decode; and the prompt is read
once (``prefill_tokens``), also when the sequence being prefilled leaves mid-prompt."""

from __future__ import annotations

import pytest
import torch

from conftest import run_rounds, varied_prompts
from test_batch import CHUNK_TOKENS, agree_models, hybrid_models, qwen35_models  # noqa: F401 (fixtures)

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.serving.scheduler import choice_seed

C = CHUNK_TOKENS


_ALONE: dict = {}  # (id(target), id(drafter), prompt, n, params) -> (target, drafter, tokens, taus)


def alone(target, drafter, prompt, n, params):
    """Tokens and acceptance lengths of ``prompt`` decoded alone, prefilled in the batch's chunks.
    (Deterministic, greedy or seeded: each is decoded once in this module, the choices of one
    request and the tests of one model asking for the same reference.)"""
    key = (id(target), id(drafter), tuple(prompt), n, params)
    if key not in _ALONE:  # (the entry holds the models: their ids stay theirs)
        decoder = SpeculativeDecoder(target, drafter, prefill_chunk=C)
        _ALONE[key] = (target, drafter, *run_rounds(decoder, prompt, n, params))
    tokens, taus = _ALONE[key][2:]
    return list(tokens), list(taus)


def choices(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The n choices of a request: greedy, or sampled with the server's derived seeds."""
    if params.greedy:
        return [params] * n
    return [SamplingParams(params.temperature, params.top_k, params.top_p, choice_seed(params.seed, j)) for j in range(n)]


def collect(batch: BatchDecoder, out: dict, taus: dict, budgets: dict, joined: dict | None = None, steps: int = 300) -> None:
    """Step until every sequence held has its budget (each removed then): tokens into
    ``out``, acceptance lengths into ``taus``, the step of each prefill round into ``joined``."""
    for k in range(steps):
        for sid, rnd in batch.step().items():
            out.setdefault(sid, []).extend(rnd.tokens)
            if rnd.acceptance_length is None:
                if joined is not None:
                    joined[sid] = k
            elif len(out[sid]) - len(rnd.tokens) < budgets[sid]:
                taus.setdefault(sid, []).append(rnd.acceptance_length)
        for sid in batch.seq_ids:
            if len(out.get(sid, [])) >= budgets[sid]:
                batch.remove(sid)
        if not batch.seq_ids:
            return
    raise AssertionError("the batch did not finish")


def run_two_requests(target, drafter, share: bool, params: SamplingParams, **kw):
    """A sequence decodes; then request "a" (3 choices of a prompt of 4 chunks + 3 tokens,
    ``params``) and request "b" (2 greedy choices of a 2-chunk prompt) join, chunked, one
    chunk per step. -> outputs, acceptance lengths, prefill steps, prompt tokens the target read
    after the first sequence's prefill, and the prompts."""
    prompts = {"a": varied_prompts(target, 1, seed=21, length=4 * C + 3)[0],
               "b": varied_prompts(target, 1, seed=22, length=2 * C)[0], "o": [5, 6, 7]}
    batch = BatchDecoder(target, drafter, max_batch_size=6, max_context=160, prefill_chunk=C, share_prefill=share, **kw)
    budgets = {"o": 90, ("a", 0): 30, ("a", 1): 25, ("a", 2): 30, ("b", 0): 20, ("b", 1): 20}
    out, taus, joined = {"o": list(batch.add("o", prompts["o"], SamplingParams(), budgets["o"]).tokens)}, {}, {}
    read = batch.prefill_tokens
    for req, ps in (("a", choices(params, 3)), ("b", choices(SamplingParams(), 2))):
        for j, p in enumerate(ps):
            batch.join((req, j), prompts[req], p, budgets[(req, j)])
    assert batch.free_slots == 0
    collect(batch, out, taus, budgets, joined)
    return out, taus, joined, batch.prefill_tokens - read, prompts, budgets


def check_alone(target, drafter, out, taus, prompts, budgets, params):
    ps = {("a", j): p for j, p in enumerate(choices(params, 3))} | {("b", j): SamplingParams() for j in range(2)}
    for sid, p in ps.items():
        tokens, expected_taus = alone(target, drafter, prompts[sid[0]], budgets[sid], p)
        assert (out[sid][:budgets[sid]], taus.get(sid, [])) == (tokens, expected_taus), sid


SAMPLED = SamplingParams(temperature=0.9, top_k=50, seed=17)


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampling"])
@pytest.mark.parametrize("models", ["agree_models", "hybrid_models", "qwen35_models", "moe_models", "dflash2_models"],
                         ids=["attention", "qwen3-next-hybrid-moe", "qwen35-hybrid", "qwen3-moe", "dflash2"])
def test_choices_sharing_a_prefill_decode_as_with_their_own(request, models, params):
    """Two requests of 3 and 2 choices join while a sequence decodes: each request's prompt
    is read once (its chunks one per step), its choices get their first tokens in the step
    that reads its last chunk, and every choice's tokens and acceptance lengths equal its
    decode alone and its decode with a prefill of its own (``share_prefill=False``, and
    ``reuse_prefix=False``, else the later choices would copy the first one's rows)."""
    target, drafter = request.getfixturevalue(models)
    out, taus, joined, read, prompts, budgets = run_two_requests(target, drafter, True, params)
    n_a, n_b = len(prompts["a"]), len(prompts["b"])
    assert read == n_a + n_b
    assert {joined[("a", j)] for j in range(3)} == {4} and {joined[("b", j)] for j in range(2)} == {6}
    check_alone(target, drafter, out, taus, prompts, budgets, params)
    own, own_taus, own_joined, own_read, _, _ = run_two_requests(target, drafter, False, params, reuse_prefix=False)
    assert own_read == 3 * n_a + 2 * n_b and (own, own_taus) == (out, taus)
    assert sorted(own_joined.values()) == [4, 9, 14, 16, 18]  # (each choice read its own prompt, in turn)


@pytest.mark.parametrize("models,mode", [("agree_models", "fixed-shapes"), ("hybrid_models", "fixed-shapes"),
                                         ("hybrid_models", "compiled")],
                         ids=["attention-fixed-shapes", "qwen3-next-hybrid-moe-fixed-shapes", "qwen3-next-hybrid-moe-compiled"])
def test_choices_sharing_a_prefill_with_fixed_shapes_and_compiled(request, models, mode):
    """Fixed-shape and compiled rounds (padding rows in the sharers' free slots while the
    prompt is read): the prompt is read once, every choice decodes as alone. Compiled with
    the "eager" backend (TorchDynamo's graphs, cheap to build)."""
    target, drafter = request.getfixturevalue(models)
    kw = dict(static=True) if mode == "fixed-shapes" else dict(compile=True, compile_backend="eager")
    if mode == "compiled":
        torch._dynamo.reset()
    out, taus, joined, read, prompts, budgets = run_two_requests(target, drafter, True, SAMPLED, **kw)
    assert read == len(prompts["a"]) + len(prompts["b"])
    check_alone(target, drafter, out, taus, prompts, budgets, SAMPLED)


def test_target_only_choices_share_a_prefill(qwen35_models):  # noqa: F811 (the imported fixture)
    """Target-only decoding of a hybrid target with fixed shapes (each row advances its own
    recurrent state as it runs; padding rows in the sharers' slots advance none): the
    prompt is read once and every choice decodes as alone."""
    target, _ = qwen35_models
    out, taus, joined, read, prompts, budgets = run_two_requests(target, None, True, SAMPLED, static=True)
    assert read == len(prompts["a"]) + len(prompts["b"])
    check_alone(target, None, out, taus, prompts, budgets, SAMPLED)


@pytest.mark.parametrize("models", ["agree_models", "hybrid_models", "qwen35_models"],
                         ids=["attention", "qwen3-next-hybrid-moe", "qwen35-hybrid"])
def test_sequences_leaving_while_their_shared_prompt_is_read(request, models):
    """The sequence whose prompt is being read leaves after 2 of its 5 chunks: the next
    choice takes over its slot and the 2 chunks read, the prompt is still read once in
    all, and the remaining choices decode as alone; a choice that leaves while it waits
    frees its slot at once; a decoding sequence leaving mid-prompt moves the shared
    prompt's slot down. A request whose first choice leaves before its prompt is started
    has the next choice read it. A whole request leaving mid-prompt frees every slot and
    the next prompt starts from scratch there."""
    target, drafter = request.getfixturevalue(models)
    prompt = varied_prompts(target, 1, seed=31, length=4 * C + 5)[0]
    other = varied_prompts(target, 1, seed=32, length=C + 2)[0]
    ps = choices(SAMPLED, 4)
    # (reuse off: the prompt is decoded twice here, and its second prefill must read it)
    batch = BatchDecoder(target, drafter, max_batch_size=6, max_context=160, prefill_chunk=C, reuse_prefix=False)
    budgets = {"o": 120, "p": 100, 0: 30, 1: 30, 2: 25, 3: 30, "x0": 25, "x1": 25, "y": 20}
    out, taus = {sid: list(batch.add(sid, [5 + k, 6, 7], SamplingParams(), budgets[sid]).tokens)
                 for k, sid in enumerate(("o", "p"))}, {}
    read = batch.prefill_tokens
    for j in range(4):
        batch.join(j, prompt, ps[j], budgets[j])
    assert batch.free_slots == 0 and batch.seq_ids == ["o", "p", 0, 1, 2, 3]

    def step(expected: set):
        rounds = batch.step()
        assert set(rounds) == expected
        for sid, rnd in rounds.items():
            out.setdefault(sid, []).extend(rnd.tokens)
            if rnd.acceptance_length is not None:
                taus.setdefault(sid, []).append(rnd.acceptance_length)

    step({"o", "p"})
    step({"o", "p"})  # 2 of 5 chunks read, in slot 2
    batch.remove(0)  # 1 takes over slot 2 and the chunks read
    batch.remove(2)  # waiting: its slot is free at once
    assert batch.free_slots == 2 and batch.seq_ids == ["o", "p", 1, 3]
    step({"o", "p"})
    batch.remove("o")  # "p" moves to slot 0, the prompt read so far to slot 1
    step({"p"})
    step({"p", 1, 3})  # the 5th chunk: both choices' first tokens
    assert batch.prefill_tokens - read == len(prompt)
    # a request whose first choice leaves before its prompt is started: the next one reads it
    batch.join("x0", other, ps[0], budgets["x0"])
    batch.join("x1", other, ps[1], budgets["x1"])
    batch.remove("x0")
    assert batch.seq_ids == ["p", 1, 3, "x1"]
    collect(batch, out, taus, budgets)
    assert batch.prefill_tokens - read == len(prompt) + len(other) and batch.free_slots == 6
    for sid, p, pr in ((1, ps[1], prompt), (3, ps[3], prompt), ("x1", ps[1], other)):
        assert (out[sid][:budgets[sid]], taus[sid]) == alone(target, drafter, pr, budgets[sid], p), sid
    # a whole request leaves mid-prompt; another prompt then reads from scratch in that slot
    out["p"] = list(batch.add("p", [5, 6, 7], SamplingParams(), budgets["p"]).tokens)
    for j in range(3):
        batch.join(j, prompt, ps[j], budgets[j])
    step({"p"})
    for j in range(3):
        batch.remove(j)
    assert batch.seq_ids == ["p"] and batch.free_slots == 5
    batch.join("y", other, ps[2], budgets["y"])
    collect(batch, out, taus, budgets)
    assert (out["y"][:budgets["y"]], taus["y"]) == alone(target, drafter, other, budgets["y"], ps[2])
    assert out["p"][:budgets["p"]] == alone(target, drafter, [5, 6, 7], budgets["p"], SamplingParams())[0]


def test_generate_batch_reads_a_repeated_prompt_once(agree_pair):
    """generate_batch of one prompt three times (seeds of three choices) reads it once and
    each result equals generate alone; share_prefill must be a bool."""
    engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=3, max_context=256)
    prompt = list(range(20, 20 + 300 // 2))
    seeds = [choice_seed(5, j) for j in range(3)]
    expected = [engine.generate(prompt, max_new_tokens=20, temperature=0.9, seed=s, ignore_eos=True).token_ids
                for s in seeds]
    read = engine.batch_decoder().prefill_tokens
    got = engine.generate_batch([prompt] * 3, max_new_tokens=20, temperature=0.9, seed=seeds, ignore_eos=True)
    assert [g.token_ids for g in got] == expected
    assert engine.batch_decoder().prefill_tokens - read == len(prompt)
    with pytest.raises(DFlashError, match="^share_prefill must be True or False, got 'no'$"):
        BatchDecoder(engine.target, engine.drafter, max_batch_size=1, max_context=64, share_prefill="no")
