"""Structured outputs (dflash_torch/structured.py): JSON schema, JSON object, regex, choice and
Lark grammar constraints through llguidance.

Oracles: llguidance itself, driven token by token by a fresh matcher (the masks of a
verify block, the state after a round); transformers' own ``generate`` with a logits
processor that masks each step by such a matcher (constrained target-only decoding); and
constrained target-only decoding for speculative decoding, which must commit exactly the
same tokens in every mode (eager, fixed shapes, recompute, batched, DFlash 2, a hybrid
target). With sampling, the outputs follow the exact constrained distribution (chi-square).
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
import torch
import transformers
from conftest import EOS_ID, load_hf
from test_sampling import ALPHA, chi_square_pvalue

from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.models.dflash2 import DFlash2Drafter
from dflash_torch.sampling import LogitsProcessor, SamplingParams
from dflash_torch.structured import JSON_DEFAULTS, GrammarCompiler, StructuredOutput, unpack_bitmask

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["A", "B", "IX"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
UPPER = r"[A-Z ]{1,40}"  # lets the agreeable target's favourite token ('I') through: long accepted runs
SPECS = {
    "json": {"json": SCHEMA},
    "json_object": {"json_object": True},
    "regex": {"regex": UPPER},
    "choice": {"choice": ["IIII", "I I", "AB", "IIIIIIIIIIIIIIIIIIIIIIIIII"]},
    "grammar": {"grammar": 'start: "I" WORD (" " WORD)*\nWORD: /[A-Z]{1,6}/'},
    # forced text around an embedded schema (as hermes tool calls): llguidance's masks keep only
    # the canonical tokenization of forced text, which validate_tokens does not
    "forced": {"grammar": 'start: "{\\"name\\": " args "}"\nargs: %json {"type": "object", "properties": '
                          '{"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], '
                          '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}'},
}


def oracle_grammar(spec: dict) -> str:
    """The llguidance grammar of a spec, built with llguidance's own constructors."""
    M = llguidance.LLMatcher
    (kind, value), = spec.items()
    if kind == "json":
        return M.grammar_from_json_schema(value, defaults=None if "x-guidance" in value else JSON_DEFAULTS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return M.grammar_from_regex(value)
    if kind == "choice":
        return M.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in value))
    return M.grammar_from_lark(value)


def oracle_tokenizer(engine):
    return llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.target.config.vocab_size,
                                        eos_token=sorted(engine.stop_token_ids))


def allowed_by(matcher, vocab: int) -> torch.Tensor:
    """bool [V]: the tokens a matcher allows next (its byte-per-token bias: 0 or 200)."""
    return torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0


class HFGrammarMask(transformers.LogitsProcessor):
    """transformers logits processor: -inf for what a fresh llguidance matcher does not allow."""

    def __init__(self, tokenizer, grammar: str, vocab: int):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.vocab, self.prompt_len = vocab, None

    def __call__(self, input_ids, scores):
        ids = input_ids[0].tolist()
        if self.prompt_len is None:
            self.prompt_len = len(ids)
        else:
            assert self.matcher.consume_token(ids[-1])
        return scores.masked_fill(~allowed_by(self.matcher, self.vocab)[None, :scores.shape[-1]], float("-inf"))


@pytest.fixture(scope="module")
def engines(tiny_pair, agree_pair, agree_dflash2_pair):
    """Engines (float32): the tiny random pair and the agreeable pair (inject / recompute /
    fixed shapes / DFlash 2 / target-only)."""
    t, d = agree_pair
    return {
        "tiny": DFlashEngine.from_pretrained(*tiny_pair, dtype="float32"),
        "tiny-target": DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True, dtype="float32"),
        "inject": DFlashEngine.from_pretrained(t, d, dtype="float32", max_batch_size=4),
        "recompute": DFlashEngine.from_pretrained(t, d, dtype="float32", draft_mode="recompute"),
        "static": DFlashEngine.from_pretrained(t, d, dtype="float32", static=True, max_context=256, max_batch_size=4),
        "dflash2": DFlashEngine.from_pretrained(t, agree_dflash2_pair[1], dtype="float32"),
        "target": DFlashEngine.from_pretrained(t, no_draft=True, dtype="float32"),
    }


# --- the matcher state against llguidance driven by hand ---


def test_block_masks_and_commits_equal_a_fresh_matcher(engines):
    """Random rounds of drafts (valid ones, and some the grammar refuses) and commits of an
    accepted prefix plus a bonus token: every mask row equals that of a fresh matcher fed
    the committed tokens and the drafts before the row; rows past a refused draft are all
    True; after each commit the state equals a fresh matcher over the committed tokens."""
    engine = engines["tiny"]
    V = engine.target.config.vocab_size
    tok = oracle_tokenizer(engine)
    g = torch.Generator().manual_seed(0)
    for name in ("json", "regex", "grammar"):
        grammar = engine.grammars.compile(SPECS[name])
        state = grammar.state("cpu")
        committed: list[int] = []
        for _ in range(12):
            fresh = llguidance.LLMatcher(tok, oracle_grammar(SPECS[name]))
            assert fresh.consume_tokens(committed)
            if fresh.is_stopped():
                break
            draft, refused = [], None  # a walk of allowed tokens, sometimes one refused token
            walker = fresh.deep_copy()
            for j in range(7):
                allowed = allowed_by(walker, V).nonzero()[:, 0]
                if torch.rand(1, generator=g) < 0.15 or walker.is_stopped():
                    bad = (~allowed_by(walker, V)).nonzero()[:, 0]
                    draft.append(int(bad[torch.randint(len(bad), (1,), generator=g)]))
                    refused = j
                    break
                draft.append(int(allowed[torch.randint(len(allowed), (1,), generator=g)]))
                assert walker.consume_token(draft[-1])
            masks = state.masks(draft)
            assert masks.shape == (len(draft) + 1, V)
            ref = fresh.deep_copy()
            for j in range(len(draft) + 1):
                if refused is not None and j > refused:
                    assert masks[j].all(), (name, j)
                    continue
                assert torch.equal(masks[j], allowed_by(ref, V)), (name, j)
                if j < len(draft) and (refused is None or j < refused):
                    assert ref.consume_token(draft[j])
            # commit an accepted prefix and a bonus token the grammar allows after it
            a = int(torch.randint(0, (refused if refused is not None else len(draft)) + 1, (1,), generator=g))
            after = fresh.deep_copy()
            assert after.consume_tokens(draft[:a])
            choices = allowed_by(after, V).nonzero()[:, 0]
            bonus = int(choices[torch.randint(len(choices), (1,), generator=g)])
            state.commit(draft[:a] + [bonus])
            committed += draft[:a] + [bonus]
            check = llguidance.LLMatcher(tok, oracle_grammar(SPECS[name]))
            assert check.consume_tokens(committed)
            if not check.is_stopped():
                assert torch.equal(state.masks()[0], allowed_by(check, V)), name


def test_unpack_bitmask_reads_llguidance_bit_order():
    """Bit i of word w is token 32 w + i, the sign bit included."""
    words = torch.tensor([[1 | (1 << 5), -(1 << 31), 0, 1 << 2]], dtype=torch.int32)
    got = unpack_bitmask(words, 100)[0].nonzero()[:, 0].tolist()
    assert got == [0, 5, 63, 98]


def random_walk(grammar, committed: list[int], n: int, g, refuse: float = 0.0) -> list[int]:
    """Up to ``n`` tokens after ``committed`` that the grammar allows (with probability
    ``refuse`` per step, a token it refuses, which ends the walk), stopping after an EOS."""
    walker = grammar.state("cpu")
    walker.commit(committed)
    out = []
    for _ in range(n):
        allowed = walker.next_allowed()
        if allowed is None:
            break
        refused = torch.rand(1, generator=g) < refuse
        pool = (~allowed if refused else allowed).nonzero()[:, 0]
        out.append(int(pool[torch.randint(len(pool), (1,), generator=g)]))
        if refused or out[-1] == EOS_ID:
            break
        assert walker.advance(out[-1])
    return out


def test_allows_agrees_with_the_mask(engines):
    """GrammarState.allows (llguidance's validate_tokens where no mask is cached; the mask
    for an EOS) == the mask's bit, for every token, at states along random valid paths."""
    engine = engines["tiny"]
    V = engine.target.config.vocab_size
    g = torch.Generator().manual_seed(2)
    for name in ("json", "choice", "grammar", "regex", "forced"):
        grammar = engine.grammars.compile(SPECS[name])
        for _ in range(3):
            path = random_walk(grammar, [], 12, g)
            for k in range(len(path)):
                probe, ref = grammar.state("cpu"), grammar.state("cpu")
                probe.commit(path[:k])
                ref.commit(path[:k])
                assert [probe.allows(t) for t in range(V)] == ref.next_allowed().tolist(), (name, path[:k])


def test_allows_agrees_with_the_mask_on_the_shipped_tokenizer():
    """The same on the shipped pair's 4096-token vocabulary, whose merged tokens (' "') give
    forced text two tokenizations (llguidance's validate_tokens accepts both, its mask one);
    and greedy speculative == target-only decoding there (a tool-call-like grammar)."""
    spec_engine = DFlashEngine.from_pretrained(dtype="float32")
    engine = DFlashEngine.from_pretrained(no_draft=True, dtype="float32")
    V = engine.target.config.vocab_size
    grammar = engine.grammars.compile(SPECS["forced"])
    path = engine.encode_prompt('{"name": {"n": 7}}')
    for k in range(len(path)):
        probe, ref = grammar.state("cpu"), grammar.state("cpu")
        probe.commit(path[:k])
        ref.commit(path[:k])
        assert [probe.allows(t) for t in range(V)] == ref.next_allowed().tolist(), path[:k]
    for prompt in ("def f(x):", "x = {", "import json\n"):
        want = engine.generate(prompt, max_new_tokens=40, structured_output=SPECS["forced"])
        assert spec_engine.generate(prompt, max_new_tokens=40, structured_output=SPECS["forced"]).token_ids == \
            want.token_ids
        assert json.loads(want.text)["name"]["n"] in range(10)


@pytest.mark.parametrize("name", ["json", "choice", "grammar", "regex", "forced"])
def test_lazy_greedy_masks_decide_as_full_masks(engines, name):
    """mask_greedy masks only rows whose argmax the grammar refuses: greedy acceptance
    (accepted count and bonus token) on its output == on the fully masked block, over random
    logits and drafts (valid walks, refused tokens, EOS); ``logits`` is never written."""
    from dflash_torch.sampling import accept_greedy

    engine = engines["tiny"]
    V = engine.target.config.vocab_size
    grammar = engine.grammars.compile(SPECS[name])
    g = torch.Generator().manual_seed(4)
    masked_rows = decided = 0
    for episode in range(6):
        lazy, full, committed = grammar.state("cpu"), grammar.state("cpu"), []
        for _ in range(12):
            draft = random_walk(grammar, committed, 7, g, refuse=0.1)
            logits = torch.randn(len(draft) + 1, V, generator=g) * 3
            for j, t in enumerate(draft):  # the target often agrees with the draft (no mask needed there)
                if torch.rand(1, generator=g) < 0.7:
                    logits[j, t] += 20
            before = logits.clone()
            mine = lazy.mask_greedy(logits, draft)
            assert torch.equal(logits, before)
            ref = logits.masked_fill(~full.masks(draft), float("-inf"))
            d = torch.tensor(draft, dtype=torch.long)
            a1, b1 = accept_greedy(d, mine)
            a2, b2 = accept_greedy(d, ref)
            assert (int(a1), int(b1)) == (int(a2), int(b2)), (name, committed, draft)
            masked_rows += int((mine[:int(a2) + 1] != logits[:int(a2) + 1]).any(-1).sum())
            decided += int(a2) + 1
            tokens = draft[:int(a2)] + [int(b2)]
            lazy.commit(tokens)
            full.commit(tokens)
            committed += tokens
            if EOS_ID in tokens:
                break
    assert decided > 20 and 0 < masked_rows < decided  # (rows needed masks, and others were decided without)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guided_drafts_are_valid_continuations(engines, arch, temperature):
    """Guided drafting: every slot's token is one the grammar allows after the drafts before
    it (a fresh matcher consumes the whole draft), whatever the drafter's scores; when
    sampling, q puts all its mass on allowed tokens."""
    engine = engines["tiny"]
    V = engine.target.config.vocab_size
    tok = oracle_tokenizer(engine)
    g = torch.Generator().manual_seed(1)
    drafter = engine.drafter if arch == "dflash" else None
    params = SamplingParams(temperature=temperature, seed=3)
    for name in ("json", "regex", "grammar"):
        grammar = engine.grammars.compile(SPECS[name])
        for trial in range(6):
            processor = LogitsProcessor(SamplingParams(temperature=temperature, grammar=grammar), [5], V,
                                        torch.device("cpu"))
            gen = params.generator("cpu")
            if arch == "dflash":
                scores = torch.randn(15, V, generator=g) * 4
                draft, q = processor.choose_draft(drafter, scores, params, gen)
            else:  # a lattice with many allowed candidates: K = 64 random ids per slot
                ids = torch.stack([torch.randperm(V, generator=g)[:64] for _ in range(15)])
                edges = torch.randn(15, 64, 64, generator=g)
                walker = DFlash2Drafter.__new__(DFlash2Drafter)
                torch.nn.Module.__init__(walker)
                walker.candidate_selector = torch.nn.Module()
                walker.candidate_selector.predecessor_codebook = torch.nn.Parameter(torch.zeros(V, 1))
                draft, q = walker.choose_draft((ids, edges), params, gen, guide=processor.grammar)
            fresh = llguidance.LLMatcher(tok, oracle_grammar(SPECS[name]))
            tokens = draft.tolist()
            valid = fresh.validate_tokens(tokens)
            if arch == "dflash":  # (every slot had allowed tokens: all valid, up to an EOS)
                assert valid == len(tokens) or EOS_ID in tokens[:valid + 1], (name, tokens, valid)
            else:  # a slot none of whose 64 candidates is allowed ends the guided part
                first_bad = valid
                if first_bad < len(tokens):
                    probe = fresh.deep_copy()
                    assert probe.consume_tokens(tokens[:first_bad])
                    ok = allowed_by(probe, V)
                    assert not ok[ids[first_bad]].any() or tokens[first_bad] == EOS_ID, (name, trial)
            if q is not None:
                probe = llguidance.LLMatcher(tok, oracle_grammar(SPECS[name]))
                for j in range(min(valid, len(tokens))):
                    assert q[j][~allowed_by(probe, V)].sum() == 0
                    assert probe.consume_token(tokens[j])


# --- decoding against oracles ---


@pytest.mark.parametrize("name", list(SPECS))
def test_target_only_equals_transformers_generate_with_the_grammar(engines, tiny_pair, name):
    """Constrained target-only decoding == transformers' greedy generate whose every step is
    masked by a fresh llguidance matcher (and speculative decoding with the tiny pair's
    random drafter == both)."""
    engine, spec_engine = engines["tiny-target"], engines["tiny"]
    hf = load_hf(tiny_pair[0])
    tok = oracle_tokenizer(engine)
    V = engine.target.config.vocab_size
    for prompt in ("def f(x):", "import os\n"):
        ids = engine.encode_prompt(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=40, do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                              logits_processor=[HFGrammarMask(tok, oracle_grammar(SPECS[name]), V)])
        ref = out[0, len(ids):].tolist()
        ours = engine.generate(ids, max_new_tokens=40, structured_output=SPECS[name])
        assert ours.token_ids == ref, (name, prompt)
        assert spec_engine.generate(ids, max_new_tokens=40, structured_output=SPECS[name]).token_ids == ref
        fresh = llguidance.LLMatcher(tok, oracle_grammar(SPECS[name]))
        assert fresh.validate_tokens(ref) == len(ref)  # (the check compares a valid output)


def test_compiled_rounds_with_a_constraint_equal_target_only(engines):
    """torch.compile (eager backend: the graphs inductor would get) with constraints: the
    masks act outside the graphs; same tokens as constrained target-only decoding."""
    from conftest import run_rounds

    from dflash_torch.decoding import SpeculativeDecoder

    e = engines["inject"]
    compiled = SpeculativeDecoder(e.target, e.drafter, compile=True, compile_backend="eager", max_context=128)
    alone = SpeculativeDecoder(e.target, None)
    for name in ("regex", "json", "forced"):
        params = SamplingParams(grammar=e.grammars.compile(SPECS[name]))
        for prompt in ([5, 9, 13], [100, 7]):
            got, taus = run_rounds(compiled, prompt, 30, params)
            want, _ = run_rounds(alone, prompt, 30, params)
            n = want.index(EOS_ID) + 1 if EOS_ID in want else len(want)  # (run_rounds goes on past an EOS)
            assert got[:n] == want[:n], (name, prompt)


@pytest.mark.parametrize("mode", ["inject", "recompute", "static", "dflash2"])
def test_speculative_equals_constrained_target_only(engines, mode):
    """The agreeable pair, every constraint: speculative greedy output == constrained
    target-only output, token for token, with multi-token acceptances."""
    engine, reference = engines[mode], engines["target"]
    taus = []
    for name, spec in SPECS.items():
        for prompt in ([5, 9, 13], [100, 7], "def f(x):"):
            ref = reference.generate(prompt, max_new_tokens=48, structured_output=spec)
            out = engine.generate(prompt, max_new_tokens=48, structured_output=spec)
            assert out.token_ids == ref.token_ids, (mode, name, prompt)
            assert out.finish_reason == ref.finish_reason
            taus += out.stats.acceptance_lengths
    assert max(taus) > 3, mode  # drafts were accepted: the comparison saw multi-token rounds


# after "Ix" (or "III") only the special token's text could follow, which the tokenizer reads as that token
DEAD_END_SPECS = [{"choice": ["Ix<|MASK|>", "IA"]}, {"json": {"enum": ["Ix<|endoftext|>", "IA"]}},
                  {"choice": ["III<|MASK|>", "IA"]}, {"json": {"enum": ["IIII<|endoftext|>", "IA"]}}]


def _outcome(engine, prompt, spec):
    try:
        return engine.generate(prompt, max_new_tokens=20, structured_output=spec).token_ids
    except DFlashError as exc:
        return str(exc)


@pytest.mark.parametrize("mode", ["inject", "static", "dflash2"])
def test_a_dead_end_of_the_constraint_fails_as_target_only_whatever_the_drafts(engines, mode):
    """A token after which the constraint allows nothing (one or more tokens ahead) is handled
    as target-only decoding handles it, which sees no further than its committed tokens: it
    is committed and the request fails. Speculative decoding refused a draft that led into
    one, so it wrote the other choice where target-only failed: which one happened depended
    on the drafts (and on how far ahead the dead end lay)."""
    engine, reference = engines[mode], engines["target"]
    failed = 0
    for spec in DEAD_END_SPECS:
        for prompt in ([5, 9, 13], [100, 7], "x = "):
            want = _outcome(reference, prompt, spec)
            assert _outcome(engine, prompt, spec) == want, (mode, spec, prompt)
            failed += isinstance(want, str)
            if mode == "inject":
                try:
                    got = [o.token_ids for o in engine.generate_batch([prompt, prompt], max_new_tokens=20,
                                                                      structured_output=spec)]
                except DFlashError as exc:
                    got = str(exc).removeprefix("prompt 0: ")
                assert got == (want if isinstance(want, str) else [want, want])
    assert failed  # (the target walks into the dead ends)


def test_sampling_acceptance_with_a_draft_limit_keeps_the_targets_distribution():
    """accept_sampling(limit=k), k set where draft k leads into a dead end (so it depends on
    that draft): at most k drafts accepted, and row k's token still distributed as the
    target's p there (draft k, where it passes its test, is that token). Drawing row k from p
    whenever the limit applied gave the dead-ending token p(x)^2 (0.25 here, not 0.5;
    helper-69)."""
    from dflash_torch.sampling import accept_sampling, sample

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0]])  # the drafter's; token 1 leads into a dead end
    counts = [0, 0, 0]
    n = 4000
    for _ in range(n):
        draft = sample(q, g)
        limit = 0 if int(draft[0]) == 1 else None
        a, token = accept_sampling(draft, q, p, g, limit=limit)
        assert limit is None or int(a) == 0
        counts[int(token) if int(a) == 0 else int(draft[0])] += 1  # (row 0's token)
    assert counts[2] == 0 and abs(counts[1] / n - 0.5) < 0.04, counts


def test_constraint_changes_the_output_and_is_honoured(engines):
    """Guard: without the constraint the target writes other tokens; with it, the text
    matches (the regex, a choice, JSON valid under the schema) and ends with EOS."""
    import re

    engine = engines["inject"]
    free = engine.generate([5, 9, 13], max_new_tokens=48)
    out = engine.generate([5, 9, 13], max_new_tokens=48, structured_output=SPECS["regex"])
    assert out.token_ids != free.token_ids
    assert out.finish_reason == "stop" and re.fullmatch(UPPER, out.text), out.text
    choice = engine.generate([5, 9, 13], max_new_tokens=48, structured_output=SPECS["choice"])
    assert choice.text in SPECS["choice"]["choice"] and choice.finish_reason == "stop"
    compact = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})  # (this model pads with whitespace)
    out = engine.generate("x = ", max_new_tokens=200, structured_output={"json": compact})
    assert out.finish_reason == "stop" and " " not in out.text and "\r" not in out.text, out.text
    value = json.loads(out.text)
    assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    assert value["tag"] in ("A", "B", "IX")


def test_a_choice_of_thousands_of_strings(engines):
    """vLLM's guided_choice takes long lists: 5,000 choices (llguidance's parser refused a rule of
    more than 2,000 alternatives at the first token) decode speculatively as target-only, and
    one far down the list is written where a logit bias leads to it."""
    words = [f"w{i}" for i in range(4999)] + ["zebra crossing"]
    spec = {"choice": words}
    for prompt in ([5, 9, 13], "x = "):
        ref = engines["target"].generate(prompt, max_new_tokens=16, structured_output=spec)
        assert ref.text in words and ref.finish_reason == "stop", ref.text
        assert engines["inject"].generate(prompt, max_new_tokens=16, structured_output=spec).token_ids == ref.token_ids
    first = engines["target"].tokenizer.encode("zebra crossing", add_special_tokens=False)[0]
    for mode in ("target", "inject"):
        out = engines[mode].generate([5, 9, 13], max_new_tokens=16, structured_output=spec, logit_bias={first: 100.0})
        assert out.text == "zebra crossing" and out.finish_reason == "stop", (mode, out.text)


@pytest.mark.parametrize("mode", ["inject", "static"])
def test_batch_with_mixed_constraints_equals_alone(engines, mode):
    """generate_batch with a constraint per prompt (and unconstrained ones, sampled ones)
    == each prompt decoded alone."""
    engine = engines[mode]
    prompts = [[5, 9, 13], [100, 7], [7, 7, 3], [64, 250], [3, 17], [42, 42]]
    specs = [SPECS["regex"], None, SPECS["json"], SPECS["choice"], SPECS["grammar"], SPECS["regex"]]
    temps = [0.0, 0.0, 0.0, 0.0, 0.0, 0.8]
    outs = engine.generate_batch(prompts, max_new_tokens=40, structured_output=specs, temperature=temps, seed=11)
    for p, s, t, out in zip(prompts, specs, temps, outs):
        alone = engine.generate(p, max_new_tokens=40, structured_output=s, temperature=t, seed=11)
        assert out.token_ids == alone.token_ids, (p, s, t)


def test_hybrid_target_speculative_equals_target_only(agree_hybrid_pair):
    """A Qwen3-Next (Gated DeltaNet + attention, experts) target: constrained speculative ==
    constrained target-only, single and batched."""
    t, d = agree_hybrid_pair
    spec_engine = DFlashEngine.from_pretrained(t, d, dtype="float32", max_batch_size=2)
    reference = DFlashEngine.from_pretrained(t, no_draft=True, dtype="float32")
    prompts = [[5, 9, 13], [100, 7]]
    refs = [reference.generate(p, max_new_tokens=32, structured_output=SPECS["regex"]).token_ids for p in prompts]
    assert [spec_engine.generate(p, max_new_tokens=32, structured_output=SPECS["regex"]).token_ids
            for p in prompts] == refs
    batch = spec_engine.generate_batch(prompts, max_new_tokens=32, structured_output=SPECS["regex"])
    assert [o.token_ids for o in batch] == refs


def test_sampling_follows_the_exact_constrained_distribution(engines):
    """Temperature 1 with a choice constraint: the speculative outputs' frequencies fit the
    target's own constrained distribution (each token sequence's probability is the product
    of the target's masked, renormalised probabilities along it; chi-square)."""
    engine, reference = engines["inject"], engines["target"]
    spec = {"choice": ["II", "IIII", "I I", "AB", "IIIIII", "BIIIII"]}
    tok = oracle_tokenizer(reference)
    grammar = oracle_grammar(spec)
    V = reference.target.config.vocab_size
    prompt = [5, 9, 13]
    probs: dict[tuple, float] = {}

    def walk(seq: list[int], p: float):  # every token path of the constrained target
        if seq and seq[-1] == EOS_ID:  # (the output ends with its EOS)
            probs[tuple(seq)] = probs.get(tuple(seq), 0.0) + p
            return
        m = llguidance.LLMatcher(tok, grammar)
        assert m.consume_tokens(seq)
        logits = target_logits(reference, prompt + seq)
        dist = logits.double().masked_fill(~allowed_by(m, V), float("-inf")).softmax(-1)
        for t in dist.nonzero()[:, 0].tolist():
            if dist[t] * p > 1e-7:
                walk(seq + [t], p * float(dist[t]))

    walk([], 1.0)
    n = 300
    counts: dict[tuple, int] = {}
    for seed in range(n):
        out = engine.generate(prompt, max_new_tokens=24, structured_output=spec, temperature=1.0, seed=seed)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert set(counts) <= set(probs)
    assert chi_square_pvalue(counts, probs, n) > ALPHA, (counts, probs)


def target_logits(engine, ids: list[int]) -> torch.Tensor:
    """The target's logits [V] at the last of ``ids`` (one forward over them)."""
    target = engine.target
    cache = target.new_cache()
    cache.reset(len(ids))
    x = torch.tensor(ids)
    with torch.inference_mode():
        logits, _ = target(x, torch.arange(len(ids)), cache, len(ids), logits_from=len(ids) - 1)
    return logits[-1].float()


# --- errors ---


DEEP_CHAINS = """
import json, sys
from dflash_torch import DFlashEngine
e = DFlashEngine.from_pretrained(no_draft=True, dtype="float32")
lark = "start: a0\\n" + "".join(f'a{i}: "x" a{i + 1} | "y"\\n' for i in range(3000)) + 'a3000: "z"\\n'
defs = {f"a{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/a{i + 1}"}}, "required": ["n"]}
        for i in range(1500)}
defs["a1500"] = {"type": "string"}
for so in ({"grammar": lark}, {"json": {"$ref": "#/$defs/a0", "$defs": defs}}):
    print(json.dumps(e.generate("x = ", max_new_tokens=4, structured_output=so).text), flush=True)
"""


def test_long_chains_of_rules_and_refs_compile_without_overflowing_the_stack():
    """llguidance builds a grammar recursively on the calling thread's stack: 3,000 chained Lark
    rules or 1,500 chained $refs (a 70 KB request) overflowed an 8 MiB stack, a segmentation
    fault that killed the server (run in a child process here: a crash is its exit code)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DEEP_CHAINS], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lark_text, json_text = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lark_text in ("y", "z") or lark_text.startswith("x")
    assert json_text.startswith("{")


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "foo"}}, "json is invalid"),
    # (a keyword llguidance does not implement, a $ref to nothing: in words, trial-292's 'Unimplemented keys: [...]')
    ({"json": {"type": "array", "uniqueItems": True, "contains": {}}},
     r"^structured_output json is invalid: the JSON Schema keywords 'contains' and 'uniqueItems' are not supported "
     r"\(constrained decoding cannot enforce them\)$"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}}},
     r"^structured_output json is invalid: the \$ref '#/\$defs/X' points to nothing in the schema$"),
    # (not JSON: a TypeError traceback from the cache key; NaN reached llguidance as null)
    ({"json": {"enum": {"a", "b"}}}, "json must be JSON: Object of type set is not JSON serializable"),
    ({"json": {"type": "number", "minimum": float("nan")}}, "json must be JSON: Out of range float values"),
    ({"json": "{not json"}, "not JSON"),
    ({"json": "[" * 100000 + "]" * 100000}, "json is nested too deeply"),  # (a RecursionError: a 500 in the server)
    ({"grammar": 'start: "a"' + ' | "b"' * 200000}, "grammar is too large: its grammar has 1,200,010 characters"),
    ({"regex": "[a-z"}, "regex is invalid"),
    ({"grammar": "start: 'yes'"}, "grammar is invalid"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({}, "exactly one"),
    # (a kind given a value that asks for nothing: named, not "got none", trial-233)
    ({"json_object": False}, r"^structured_output json_object must be true \(the output is any JSON object\), got "
                             r"False, which asks for no constraint \(leave structured_output out for none\)$"),
    ({"json": None, "choice": None}, r"^structured_output json is None, which asks for no constraint: give it a value"),
    ({"json_object": 0}, r"^structured_output json_object must be true or false, got 0$"),
    ({"jsn": {}}, "unknown keys jsn"),
    ("json", "must be a StructuredOutput"),
])
def test_bad_constraints_are_refused_in_one_line(engines, spec, words):
    with pytest.raises(DFlashError, match=words) as info:
        engines["tiny"].generate("x", max_new_tokens=4, structured_output=spec)
    assert "\n" not in str(info.value) and str(info.value).startswith("structured_output")


def test_json_object_none_beside_another_kind_is_not_given(engines):
    """``json_object`` None beside another kind is not given, as another kind's None is and as
    the server takes its null (it was refused: "must be true or false, got None"; trial-235)."""
    e = engines["tiny"]
    for spec in ({"json_object": None, "regex": "[a-z]+"}, {"json": None, "regex": "[a-z]+"}):
        assert e.generate("x", max_new_tokens=4, structured_output=spec).token_ids == \
            e.generate("x", max_new_tokens=4, structured_output={"regex": "[a-z]+"}).token_ids


@pytest.mark.parametrize("spec", [{"regex": "[^\\x00-\\x{10FFFF}]"}, {"grammar": "start: A\nA: /[a-z]+/ & /[0-9]+/"},
                                  {"regex": "[^\\s\\S]"}, {"regex": "[a&&b]"}, {"grammar": "start: x\nx: x"}])
def test_constraints_with_no_output_are_refused_when_compiled(engines, spec):
    """A constraint whose language has no first token (no text matches it) is refused before
    decoding, in one line that says so."""
    with pytest.raises(DFlashError, match=r"^structured_output (regex|grammar) allows no output") as info:
        engines["tiny"].grammars.compile(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec, words", [
    ({"regex": "a{1000}{1000}"}, "lexer error: too many expressions constructed"),
    ({"grammar": 'start: x\nx: "a" x'}, "parser error: Too many items"),
    ({"grammar": 'start: "[1,2,3]" x\nx: "a" x'}, "parser error: Too many items"),  # (after forced text)
])
def test_constraints_llguidance_fails_on_at_the_first_token_are_refused_when_compiled(engines, spec, words):
    """llguidance's parser and lexer limits are met when a token is consumed: a constraint that
    fails at every first token is refused before decoding (generate and stream raise before a
    token), not at decoding time."""
    e = engines["tiny"]
    want = rf"^structured_output {next(iter(spec))} cannot be used \(llguidance fails on it at its first token\): "
    with pytest.raises(DFlashError, match=want + ".*" + words.replace("(", r"\(")) as info:
        e.grammars.compile(spec)
    assert "\n" not in str(info.value)
    with pytest.raises(DFlashError, match=want):
        e.generate("x", max_new_tokens=4, structured_output=spec)
    chunks = e.stream("x", max_new_tokens=4, structured_output=spec)
    with pytest.raises(DFlashError, match=want):
        next(iter(chunks))
    # (one usable first token is enough: the others are refused where they stand, as decoding does)
    assert e.generate("x", max_new_tokens=4, structured_output={"grammar": 'start: "b" | x\nx: "a" x'}).text == "b"


def test_grammars_llguidance_cannot_roll_back_decode_speculatively(engines):
    """max_tokens= lexemes (llguidance cannot roll them back): matchers are copied, never
    rolled back, so speculative decoding == target-only decoding for them too."""
    spec = {"grammar": 'start: x "!"\nx[max_tokens=3]: /[A-Z]+/'}
    for prompt in ([5, 9, 13], [100, 7]):
        ref = engines["target"].generate(prompt, max_new_tokens=24, structured_output=spec)
        assert ref.text.endswith("!") and ref.finish_reason == "stop"
        for mode in ("inject", "static", "dflash2"):
            assert engines[mode].generate(prompt, max_new_tokens=24, structured_output=spec).token_ids == ref.token_ids


def test_json_schema_true_false_and_property_order(engines):
    """The schema true is any JSON value (as {}); false is refused; two schemas that differ
    only in the order of their properties are two constraints (the order is the output's)."""
    e = engines["target"]
    json.loads(e.generate([5, 9, 13], max_new_tokens=40, structured_output={
        "json": {"type": "object", "x-guidance": {"whitespace_flexible": False}, "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["a"]}}).text)
    assert e.grammars.compile({"json": True}).spec.json == {}
    with pytest.raises(DFlashError, match="schema false allows no value"):
        e.generate("x", max_new_tokens=4, structured_output={"json": False})
    base = {"type": "object", "required": ["zeta", "alpha"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}}
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    za = dict(base, properties={"zeta": digit, "alpha": digit})
    az = dict(base, properties={"alpha": digit, "zeta": digit})
    assert e.grammars.compile({"json": za}) is not e.grammars.compile({"json": az})
    assert list(json.loads(e.generate([5], max_new_tokens=60, structured_output={"json": za}).text)) == ["zeta", "alpha"]
    assert list(json.loads(e.generate([5], max_new_tokens=60, structured_output={"json": az}).text)) == ["alpha", "zeta"]


def test_constraints_that_cannot_end_are_refused(engines):
    """ignore_eos and min_tokens would fight the constraint over where the output ends."""
    e = engines["tiny"]
    with pytest.raises(DFlashError, match="ignore_eos cannot be combined"):
        e.generate("x", max_new_tokens=4, structured_output=SPECS["regex"], ignore_eos=True)
    with pytest.raises(DFlashError, match="min_tokens cannot be combined"):
        e.generate("x", max_new_tokens=4, structured_output=SPECS["regex"], min_tokens=2)
    with pytest.raises(DFlashError, match="grammar must be a compiled"):
        SamplingParams(grammar="start: x")


def _writes(engine, spec, text: str) -> bool:
    """Whether the constraint lets the output be exactly ``text`` (its tokens, then EOS)."""
    state = engine.grammars.compile(spec).state("cpu")
    return all(state.advance(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)) and \
        state.allows(EOS_ID)


def test_pretty_printed_json_is_allowed_and_the_whitespace_bounded(engines):
    """The default JSON whitespace (one line break and at most 64 spaces or tabs) takes
    json.dumps(v, indent=4) 16 levels deep, indent=2 32 deep, tabs 64 deep (16 spaces refused
    indent=4 past 4 levels); more whitespace than that, or a blank line, is refused."""
    e = engines["tiny"]

    def nested(depth):
        return {"a": nested(depth - 1)} if depth else 1

    for indent, depth in ((4, 16), (2, 32), ("\t", 64), (None, 64)):
        text = json.dumps(nested(depth), indent=indent)
        assert _writes(e, {"json_object": True}, text), (indent, depth)
        assert _writes(e, {"json": {"type": "object"}}, text), (indent, depth)
    assert _writes(e, {"json_object": True}, '{\n' + " " * 64 + '"a": 1}')
    assert not _writes(e, {"json_object": True}, '{\n' + " " * 65 + '"a": 1}')
    assert not _writes(e, {"json_object": True}, '{\n\n"a": 1}')


def test_compiled_constraints_are_cached_per_spec(engines):
    """The same constraint (a dict, its StructuredOutput, a schema as text) compiles once."""
    c: GrammarCompiler = engines["tiny"].grammars
    a = c.compile({"json": SCHEMA})
    assert c.compile(StructuredOutput(json=json.dumps(SCHEMA))) is a
    assert c.compile({"json": {"type": "object"}}) is not a


def test_equal_constraints_hash_equal():
    """StructuredOutput is a frozen dataclass with a hash, but hash() raised "unhashable type:
    'dict'" for a JSON schema (trial-310): equal constraints (a schema as a dict or its text, its
    keys in another order) hash equal, and a schema nested deeper than the hash follows hashes too."""
    reordered = {"additionalProperties": False, "required": ["ok", "n", "tag"],
                 "properties": {"tag": {"enum": ["A", "B", "IX"]}, "n": {"maximum": 99, "minimum": 0, "type": "integer"},
                                "ok": {"type": "boolean"}}, "type": "object"}
    a, b = StructuredOutput(json=SCHEMA), StructuredOutput(json=json.dumps(reordered))
    assert SCHEMA == reordered and a == b and hash(a) == hash(b)
    assert hash(StructuredOutput(choice=["x", "y"])) == hash(StructuredOutput(choice=("x", "y")))
    deep = {"type": "array", "items": {"type": "array", "items": {}}}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    assert hash(StructuredOutput(json=deep)) == hash(StructuredOutput(json=json.loads(json.dumps(deep))))
    assert len({a, b, StructuredOutput(json={"type": "object"}), StructuredOutput(json_object=True)}) == 3


def test_logprobs_and_stream_with_a_constraint(engines):
    """stream's chunks add up to generate's output; logprobs are the raw target's (as
    without a constraint: log_softmax of the unmasked logits) and the tokens are the same."""
    e = engines["inject"]
    out = e.generate([5, 9, 13], max_new_tokens=32, structured_output=SPECS["regex"], logprobs=1)
    chunks = list(e.stream([5, 9, 13], max_new_tokens=32, structured_output=SPECS["regex"]))
    assert "".join(c.text for c in chunks) == out.text and chunks[-1].finish_reason == out.finish_reason
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    raw = target_logits(e, [5, 9, 13]).log_softmax(-1)
    assert abs(out.logprobs[0].logprob - float(raw[out.token_ids[0]])) < 1e-4


def test_max_new_tokens_where_the_constraint_can_only_end_finishes_with_stop(engines):
    """An output that reaches ``max_new_tokens`` where its constraint is complete and allows
    only the EOS (a fresh llguidance matcher after its tokens is stopped) has ended as the
    constraint ends it: finish_reason ``stop``, not ``length`` (trial-292: a forced tool call
    complete up to its closing marker came back cut), in every mode, streamed and in a batch,
    as target-only; where the constraint could still go on (a choice that begins a longer
    one, a regex), ``length``."""
    oracle = oracle_tokenizer(engines["target"])
    seen = set()
    compact = {"json": dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})}  # (this model pads JSON)
    for name, spec in [("choice", SPECS["choice"]), ("json", compact), ("forced", SPECS["forced"]),
                       ("regex", SPECS["regex"])]:
        for prompt in ([5, 9, 13], [100, 7]):
            full = engines["target"].generate(prompt, max_new_tokens=64, structured_output=spec)
            assert full.token_ids[-1] == EOS_ID and full.finish_reason == "stop", (name, prompt)  # (guard)
            cut = len(full.token_ids) - 1  # (all but the EOS)
            matcher = llguidance.LLMatcher(oracle, oracle_grammar(spec))
            assert all(matcher.consume_token(t) for t in full.token_ids[:cut])
            want = "stop" if matcher.is_stopped() else "length"
            seen.add(want)
            for mode in ("target", "inject", "recompute", "static", "dflash2"):
                out = engines[mode].generate(prompt, max_new_tokens=cut, structured_output=spec)
                assert (out.token_ids, out.text, out.finish_reason) == (full.token_ids[:cut], full.text, want), \
                    (mode, name, prompt)
            chunks = list(engines["inject"].stream(prompt, max_new_tokens=cut, structured_output=spec))
            assert chunks[-1].finish_reason == want
            batch = engines["static"].generate_batch([prompt, [3, 17]], max_new_tokens=cut, structured_output=spec)
            assert batch[0].finish_reason == want and batch[0].token_ids == full.token_ids[:cut]
            if cut > 1:  # one token short of it: cut
                assert engines["inject"].generate(prompt, max_new_tokens=cut - 1,
                                                  structured_output=spec).finish_reason == "length"
    assert seen == {"stop", "length"}, seen
