"""Structured outputs: decoding constrained to a JSON schema, any JSON object, a regular
expression, a choice of strings or a context-free grammar.

The grammar engine is llguidance (the Low-level Guidance library, guidance-ai/llguidance;
Python package ``llguidance``): it compiles the constraint for the target's tokenizer and,
for every position, gives the set of tokens that keep the output inside the language
(a bit mask over the vocabulary). Our part is how that mask enters speculative decoding:

* **verify** (lossless): verify row j predicts the token after the committed tokens and
  the drafts ``d_1 .. d_j``, so its mask is the grammar's after those tokens
  (:meth:`GrammarState.masks`); the target's logits of the tokens outside it are -inf.
  Every target decision (greedy argmax, the rejection-sampling rule, the bonus token)
  then equals the decision of constrained target-only decoding at that position: the
  output is exactly what the target alone, constrained, produces (greedy: token for
  token; sampling: in distribution). A draft token the grammar refuses gets probability 0
  under the masked target, so acceptance stops there whatever the drafter proposed.
  A token after which the constraint allows nothing (a *dead end*: e.g. only a special
  token's text could follow, which the tokenizer reads as that token) is not avoided, as
  target-only decoding, which sees no further than its committed tokens, does not avoid
  it: a draft that leads into one is, where the target takes it (its greedy choice, or
  its acceptance test passed), the round's last token, no decision made past it
  (:attr:`GrammarState.draft_limit`), so it is committed and the sequence fails in the
  next round, as target-only; sampled, each row's token keeps the target's distribution.
* **propose** (acceptance only): the drafter's slots are chosen one after another, each
  among the tokens the grammar allows after the drafts before it
  (:meth:`GrammarState.next_allowed`, :meth:`GrammarState.advance`), so every draft is a
  valid continuation; the masks computed on the way are the verify's.
* **commit**: the committed state moves past the round's tokens; matchers are copied per
  token (llguidance's ``deep_copy``), never rolled back (:class:`GrammarState`).

Shapes are unchanged (masks are applied to the logits outside the compiled forwards). The
masks are computed on the host, where a position is decided (greedy decoding applies one
only where the grammar refuses a row's argmax): a few host syncs per round for a
constrained sequence, none for the others. A constraint that cannot go on mid-way fails
its own sequence only (:attr:`GrammarState.failed`, ``Round.error``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .errors import DFlashError, OptionError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON: whitespace between two tokens is at most one line break and 64 spaces or tabs of
# indentation (compact JSON, and pretty-printed JSON up to 16 levels deep at 4 spaces a level,
# 32 at 2, 64 at a tab: json.dumps(v, indent=4) went past 16 at 5 levels; llguidance's default is
# any amount, and a model that keeps writing newlines there never finishes: the shipped model
# wrote 32 of them, the limit before, after each key); a schema with its own "x-guidance" options
# (llguidance's) gets those instead
JSON_DEFAULTS = {"whitespace_pattern": r"(?:\r?\n)?[\x20\x09]{0,64}"}
GRAMMAR_CACHE_SIZE = 64  # compiled constraints kept per engine (a server sees the same schema again and again)
# llguidance builds a grammar recursively, on the calling thread's stack: about 3 KB a level of a
# chain of Lark rules, 8 to 13 KB a level of a chain of JSON-schema $refs (llguidance 1.9), so
# 3,000 chained rules overflowed an 8 MiB thread stack (a segmentation fault: the process died).
# Grammars are built on one thread with this stack (virtual memory, touched only as deep as a
# grammar goes), and their text is at most MAX_GRAMMAR_CHARS, whose deepest chains fit it.
GRAMMAR_STACK_BYTES = 512 * 2**20
MAX_GRAMMAR_CHARS = 1_000_000
# first tokens a compile tries to consume (until one is consumed) before it refuses a constraint
# that llguidance fails on at its first token (GrammarCompiler._check_first_tokens)
FIRST_TOKEN_PROBES = 64
_grammar_lock = threading.Lock()
_grammar_thread: ThreadPoolExecutor | None = None  # (its one thread has that stack)


def _after_fork() -> None:
    global _grammar_lock, _grammar_thread  # (a forked child has no grammar thread: it starts its own)
    _grammar_lock, _grammar_thread = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def on_grammar_stack(fn):
    """``fn()`` on the process's grammar thread, whose stack is :data:`GRAMMAR_STACK_BYTES`
    (llguidance's grammar construction recurses once per level of nesting); its result, or
    its exception raised here. Runs inline where the platform cannot set a thread's stack size."""
    global _grammar_thread
    with _grammar_lock:
        if _grammar_thread is None:
            try:
                previous = threading.stack_size(GRAMMAR_STACK_BYTES)  # (the process's: for this one thread)
            except (ValueError, RuntimeError):  # (not settable here)
                return fn()
            try:
                pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-grammar")
                pool.submit(int).result()  # (its thread starts now, with that stack)
            finally:
                threading.stack_size(previous)
            _grammar_thread = pool
    return _grammar_thread.submit(fn).result()


def _load_llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # (a dependency of the package; only a broken install lacks it)
        raise DFlashError(f"structured outputs need the llguidance package ({e}); pip install llguidance") from e
    return llguidance


FROZEN_DEPTH = 32  # the levels of nesting that frozen() follows (deeper: one value per type)


def frozen(value, depth: int = 0):
    """A hashable form of ``value`` that is equal wherever the values are (``==``): a mapping
    as the frozenset of its (key, frozen value) items, a list or tuple as a tuple of frozen
    items, a set as a frozenset; below :data:`FROZEN_DEPTH` levels (a deeper value: its type's
    name, the same for equal values whatever the stack) and an unhashable value of another
    type: its type's name. For the hashes of the frozen dataclasses (``hash(frozen(x))``)
    whose fields may hold dicts: :meth:`StructuredOutput.__hash__`,
    :meth:`~dflash_torch.sampling.SamplingParams.__hash__`."""
    if depth >= FROZEN_DEPTH:
        return type(value).__name__
    if isinstance(value, Mapping):
        return frozenset((frozen(k, depth + 1), frozen(v, depth + 1)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v, depth + 1) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(frozen(v, depth + 1) for v in value)
    try:
        hash(value)
    except TypeError:
        return type(value).__name__
    return value


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
            under it (OpenAI's ``response_format`` ``json_schema``; vLLM's ``json``), with at
            most one line break and 64 spaces or tabs between two tokens of JSON (:data:`JSON_DEFAULTS`:
            pretty-printed JSON up to 16 levels deep at 4 spaces a level;
            a schema with ``x-guidance`` options, llguidance's, gets those instead: e.g.
            ``{"whitespace_flexible": false}`` for compact JSON).
        json_object: True: the output is any JSON object (OpenAI's ``json_object``).
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        choice: strings; the output is exactly one of them.
        grammar: a context-free grammar in llguidance's Lark syntax (e.g.
            ``start: "yes" | "no"``); JSON schemas can be embedded with ``%json { ... }``.

    The output ends, with an EOS token of the model, once the constraint is complete and
    the grammar allows nothing more (a regex or grammar that allows more may also go on:
    the target decides between EOS and more, as any token, within the constraint).

    Raises:
        OptionError: none or several kinds given, or a value of the wrong type (name
            ``structured_output``). An invalid schema, regex or grammar is reported when
            it is compiled for a tokenizer (:meth:`GrammarCompiler.compile`).
    """

    json: Mapping | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if not isinstance(self.json_object, bool):  # (first: 0 or "" counted as not given)
            raise OptionError(f"structured_output json_object must be true or false, got {self.json_object!r}",
                              "structured_output")
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise OptionError("structured_output needs exactly one of json, json_object, regex, choice, grammar; "
                              f"got {', '.join(given) or 'none'}", "structured_output")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise OptionError(f"structured_output json must be a JSON schema; its text is not JSON: {e}",
                                      "structured_output") from None
                except RecursionError:
                    raise OptionError("structured_output json is nested too deeply", "structured_output") from None
            if schema is False:
                raise OptionError("structured_output json schema false allows no value", "structured_output")
            if schema is True:  # (the schema true: any JSON value, as {})
                schema = {}
            if not isinstance(schema, Mapping):
                raise OptionError(f"structured_output json must be a JSON schema (an object, or true), got "
                                  f"{type(schema).__name__}", "structured_output")
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise OptionError(f"structured_output {name} must be a non-empty string, got {value!r}",
                                  "structured_output")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, str) or not isinstance(c, Sequence) or not c or not all(isinstance(s, str) and s for s in c):
                raise OptionError(f"structured_output choice must be a non-empty list of non-empty strings, got {c!r}",
                                  "structured_output")
            object.__setattr__(self, "choice", tuple(c))

    @classmethod
    def coerce(cls, value) -> "StructuredOutput | None":
        """``value`` as a :class:`StructuredOutput`: one already, None, or a mapping with one of
        the keys ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``.

        Raises:
            OptionError: anything else (unknown keys included; OpenAI's ``response_format``,
                ``{"type": "json_schema", ...}``, says what to pass instead), or keys given whose values
                ask for no constraint (``json_object`` False, another key None) and none else."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise OptionError(f"structured_output must be a StructuredOutput or a dict with one of {', '.join(KINDS)}; "
                              f"got {type(value).__name__}", "structured_output")
        unknown = sorted(str(k) for k in value if k not in KINDS)
        if unknown:
            openai = value.get("type") in ("json_schema", "json_object")  # (OpenAI's response_format, as it is)
            raise OptionError(f"structured_output has unknown keys {', '.join(unknown)} (known: {', '.join(KINDS)})"
                              + ("; for OpenAI's response_format pass {'json': response_format['json_schema']['schema']}, "
                                 "or {'json_object': True} for type json_object" if openai else ""), "structured_output")
        if value and all(v is None or (k == "json_object" and v is False) for k, v in value.items()):
            # (keys given, each with a value that asks for nothing: named, not "got none")
            if value.get("json_object") is False:
                raise OptionError("structured_output json_object must be true (the output is any JSON object), got "
                                  "False, which asks for no constraint (leave structured_output out for none)",
                                  "structured_output")
            raise OptionError(f"structured_output {next(iter(value))} is None, which asks for no constraint: give it a "
                              "value, or leave structured_output out for none", "structured_output")
        # (json_object None is not given, as the other kinds' None and the server's null: not a bool to refuse)
        return cls(**{k: v for k, v in value.items() if not (k == "json_object" and v is None)})

    def __hash__(self) -> int:
        """A hash that equal constraints share (a schema given as a dict or as its JSON text, its
        keys in any order, as ``==`` compares them): over :func:`frozen` forms of the fields."""
        return hash(tuple(frozen(getattr(self, k)) for k in KINDS))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    def key(self) -> str:
        """A canonical text of the constraint (equal constraints, equal keys): the compile cache's key.

        Raises:
            OptionError: a value that is not JSON (a set, a NaN or infinite number in a schema)."""
        value = getattr(self, self.kind)  # (key order kept: a schema's property order is the output's)
        try:
            return self.kind + ":" + json.dumps(list(value) if isinstance(value, tuple) else value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise OptionError(f"structured_output {self.kind} must be JSON: {e}", "structured_output") from None
        except RecursionError:
            raise OptionError(f"structured_output {self.kind} is nested too deeply", "structured_output") from None

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked).

        Raises:
            OptionError: a JSON schema llguidance cannot read."""
        LLMatcher = _load_llguidance().LLMatcher
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = self.json if kind == "json" else {"type": "object"}
            try:
                own = isinstance(schema, Mapping) and "x-guidance" in schema  # (its own options: ours do not apply)
                return LLMatcher.grammar_from_json_schema(schema, defaults=None if own else JSON_DEFAULTS)
            except (ValueError, TypeError) as e:
                raise OptionError(f"structured_output json schema is invalid: {_first_line(e)}",
                                  "structured_output") from None
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":  # (Lark string literals take JSON's escapes)
            # one terminal, not one rule per choice: llguidance's parser holds at most 2,000 items a
            # row (a rule "start: a | b | ..." of more choices failed at the first token); a terminal's
            # alternatives are one lexeme, matched by its lexer, which takes any number
            return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_NO_POINTER = re.compile(r"Pointer '([^']*)' does not exist")


def plain_reason(reason: str) -> str:
    """llguidance's words about a JSON schema in a user's: ``Unimplemented keys: ["a", "b"]``
    as "the JSON Schema keywords 'a' and 'b' are not supported", ``Pointer '/x' does not
    exist`` as "the $ref '#/x' points to nothing in the schema"; other text as it is."""
    def keywords(m: re.Match) -> str:
        try:
            names = [str(n) for n in json.loads(f"[{m[1]}]")]
        except ValueError:
            return m[0]
        if not names:
            return m[0]
        quoted = [f"'{n}'" for n in names]
        listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
        return f"the JSON Schema keyword{'s' if len(names) > 1 else ''} {listed} " \
               f"{'are' if len(names) > 1 else 'is'} not supported (constrained decoding cannot enforce " \
               f"{'them' if len(names) > 1 else 'it'})"

    reason = _UNIMPLEMENTED.sub(keywords, reason)
    return _NO_POINTER.sub(lambda m: f"the $ref '#{m[1]}' points to nothing in the schema", reason)


def _first_line(message, kind: str = "") -> str:
    """llguidance's message in one line: its first line (the parser state it prints after is
    left out); for a ``kind`` ``"regex"``, without the place in the one-rule grammar
    llguidance wraps a regex in (``at 1(8):``, not a place in the regex); a JSON schema's
    faults in words (:func:`plain_reason`)."""
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)  # (a regex's: after its picture)
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0]) if kind == "regex" else lines[0]
    if reason and first.endswith(":"):  # 'invalid regex "(" (in regex): regex parse error:' + 'error: unclosed group'
        return f"{first.removesuffix(' regex parse error:').removesuffix(':').replace(' (in regex)', '')}: " \
               f"{reason.removeprefix('error: ')}"
    return plain_reason(first)


class Grammar:
    """A constraint compiled and checked for one tokenizer; :meth:`state` starts a sequence's matcher.

    Attributes:
        spec: the :class:`StructuredOutput` it came from.
        vocab_size: the target's vocabulary (columns of the masks).
        eos_token_ids: the ids that end the output once the constraint is complete.
    """

    def __init__(self, spec: StructuredOutput, grammar: str, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 special_token_ids: Sequence[int] = (), token_text: dict[int, str] | None = None):
        self.spec, self.grammar, self.tokenizer, self.vocab_size = spec, grammar, tokenizer, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # int64 [S]: the special tokens (EOS included) whose mask bits are checked (GrammarState._check_special)
        self.checked_ids = torch.tensor(sorted({int(t) for t in (*special_token_ids, *eos_token_ids)
                                                if 0 <= int(t) < vocab_size}), dtype=torch.long)
        self.token_text = token_text or {}  # special token id -> its text (for messages)

    def state(self, device: torch.device | str) -> "GrammarState":
        """A new sequence's :class:`GrammarState` (nothing consumed yet), masks on ``device``."""
        return GrammarState(self, device)

    def __repr__(self) -> str:
        return f"Grammar({self.spec.kind})"


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` constraints for one tokenizer (one per engine).

    Args:
        tokenizer: the target's Hugging Face tokenizer (a fast, ``tokenizers``-backed one).
        vocab_size: the target's vocabulary size (>= the tokenizer's tokens: the rest are never allowed).
        eos_token_ids: the model's EOS ids: where a complete constraint lets the output end.
        special_token_ids: the tokenizer's special tokens (none by default): each one a mask
            allows is checked against the matcher (see :meth:`GrammarState._check_special`),
            as is every token that llguidance's tokenizer takes as special (its
            ``is_special_token``: e.g. added tokens such as Qwen3's ``<think>`` and
            ``<tool_call>``, though the tokenizer marks them special=False), whose text
            llguidance never matches as text.

    The tokenizer's conversion (about a second for a 150k vocabulary) happens on the first
    :meth:`compile`; the last :data:`GRAMMAR_CACHE_SIZE` constraints stay compiled.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], special_token_ids: Sequence[int] = ()):
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.special_token_ids = sorted(int(t) for t in special_token_ids)
        self._tokenizer = None
        self._checked: list[int] | None = None  # the tokens whose mask bits are checked (checked_ids)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self):
        """The llguidance tokenizer (made on first use).

        Raises:
            DFlashError: a tokenizer llguidance cannot read (a slow, Python-only one) or a
                model without EOS ids."""
        if self._tokenizer is None:
            llg = _load_llguidance()
            if not self.eos_token_ids:
                raise DFlashError("structured outputs need the model's EOS token id (none in its config or tokenizer)")
            try:
                self._tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=self.eos_token_ids)
            except (ValueError, TypeError, RuntimeError) as e:
                raise DFlashError(f"structured outputs need a fast (tokenizers) tokenizer; this one cannot be read: "
                                  f"{_first_line(e)}") from None
        return self._tokenizer

    def checked_ids(self) -> list[int]:
        """The tokens whose mask bits are checked against the matcher (sorted): the EOS ids,
        :attr:`special_token_ids` and the tokenizer's tokens that llguidance takes as special."""
        if self._checked is None:
            tokenizer = self.tokenizer()
            n = min(self.vocab_size, len(self.hf_tokenizer))  # (not the padding ids past the tokenizer's tokens)
            llg_special = (t for t in range(n) if tokenizer.is_special_token(t))
            self._checked = sorted({*self.special_token_ids, *self.eos_token_ids, *llg_special})
        return self._checked

    def compile(self, spec) -> Grammar:
        """The compiled constraint of ``spec`` (a :class:`StructuredOutput` or its dict form).

        Raises:
            OptionError: an invalid spec, JSON schema, regex or grammar (name ``structured_output``;
                the message has llguidance's reason).
        """
        spec = StructuredOutput.coerce(spec)
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            LLMatcher = _load_llguidance().LLMatcher
            text = spec.llguidance_grammar()
            if len(text) > MAX_GRAMMAR_CHARS:
                raise OptionError(f"structured_output {spec.kind} is too large: its grammar has {len(text):,} "
                                  f"characters (at most {MAX_GRAMMAR_CHARS:,})", "structured_output")
            tokenizer = self.tokenizer()
            error, messages = on_grammar_stack(lambda: LLMatcher.validate_grammar_with_warnings(text, tokenizer))
            if error:
                raise OptionError(f"structured_output {spec.kind} is invalid: {_first_line(messages[0], spec.kind)}",
                                  "structured_output")
            probe = on_grammar_stack(lambda: LLMatcher(tokenizer, text, log_level=0))  # (a language with no first token: refused now)
            first = torch.empty((self.vocab_size + 31) // 32, dtype=torch.int32)
            if not probe.is_error():
                probe.unsafe_compute_mask_ptr(first.data_ptr(), first.numel() * 4)
            if probe.is_error():  # (llguidance cannot start it: e.g. NoExtensionBias for an empty language)
                error = _first_line(probe.get_error())
                if "NoExtensionBias" in error:  # (no string matches it: [^\s\S], [a&&b], x: x)
                    raise OptionError(f"structured_output {spec.kind} allows no output: no text matches it "
                                      f"(llguidance: {error})", "structured_output")
                raise OptionError(f"structured_output {spec.kind} cannot be used (llguidance fails on it before the "
                                  f"first token): {error}", "structured_output")
            if not bool(first.any()):
                raise OptionError(f"structured_output {spec.kind} allows no output with this tokenizer",
                                  "structured_output")
            checked = self.checked_ids()
            names = dict(zip(checked, self.hf_tokenizer.convert_ids_to_tokens(checked)))
            refused = refuse_special(first, probe, checked, set(self.eos_token_ids))
            if refused and not bool(first.any()):  # (only a special token's text can come first)
                raise OptionError(f"structured_output {spec.kind} cannot be used: "
                                  f"{special_refusal(*refused[0], names)}", "structured_output")
            if not probe.is_accepting():  # (an empty output allowed: the EOS is a first token that works)
                self._check_first_tokens(spec, probe, first)
            grammar = Grammar(spec, text, tokenizer, self.vocab_size, self.eos_token_ids, checked, names)
            self._cache[key] = grammar
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return grammar

    def _check_first_tokens(self, spec: StructuredOutput, matcher, first: torch.Tensor) -> None:
        """Refuse a constraint that llguidance fails on at every first token its mask ``first``
        allows (int32 ``[W]``; EOS left out; at most :data:`FIRST_TOKEN_PROBES` of them tried,
        special tokens first, until one is consumed: one, mostly): llguidance's parser and
        lexer limits are met only when a token is consumed (e.g. a regex ``a{1000}{1000}``: "too
        many expressions constructed"; ``start: x`` / ``x: "a" x``: "Too many items"), so such a
        constraint passed the checks above and failed every request at its first token."""
        allowed = unpack_bitmask(first[None], self.vocab_size)[0].nonzero().flatten().tolist()
        special, eos = set(self.checked_ids()), set(self.eos_token_ids)
        # (special tokens first: a grammar may name one, e.g. a tool-call marker, where the mask also
        # lets through byte tokens that llguidance then fails to consume)
        order = sorted((t for t in allowed if t not in eos), key=lambda t: t not in special)
        error = None
        for t in order[:FIRST_TOKEN_PROBES]:
            trial = matcher.deep_copy()
            if trial.consume_token(t) and not trial.is_error():
                return
            error = error or _first_line(trial.get_error())
        if error is not None:
            raise OptionError(f"structured_output {spec.kind} cannot be used (llguidance fails on it at its first "
                              f"token): {error}", "structured_output")


def refuse_special(row: torch.Tensor, matcher, checked: Sequence[int], eos) -> list[tuple[int, bool]]:
    """Clear the bits of the special tokens ``checked`` that bit mask ``row`` (int32 ``[W]``,
    just computed by ``matcher``) allows but the matcher cannot take there: an EOS before the
    constraint is complete (unless the grammar names it there and may end after it), another
    special token that it fails to consume. llguidance lets such a token's id through where
    the constraint forces the token's literal text (``{"const": "<|endoftext|>"}``: its
    tokenizer reads the text as the special token, whose bytes do not match it), which would
    end the output early (an EOS) or fail the request. Returns the refused tokens, each with
    whether the matcher consumed it (an EOS that the grammar names where the constraint
    cannot end after it) or not (its text forced)."""
    refused = []
    for t in checked:
        if not _bit(row, t):
            continue
        ok = consumed = t in eos and matcher.is_accepting()
        if not ok:  # (an EOS the grammar names as a token is consumed there, as other special tokens
            trial = matcher.deep_copy()  # are, where the output may end after it: it ends the output)
            consumed = trial.consume_token(t) and not trial.is_error()
            ok = consumed and (t not in eos or trial.is_accepting() or trial.is_stopped())
        if not ok:
            _set_bit(row, t, False)
            refused.append((t, consumed))
    return refused


def special_refusal(token: int, consumed: bool, names: Mapping[int, str]) -> str:
    """Why nothing can be written where only the refused special ``token`` was allowed
    (:func:`refuse_special`)."""
    name = f"{token} ({names.get(token, '?')!r})"
    if consumed:  # (an EOS the grammar names, with more of the constraint after it)
        return (f"the constraint requires the special token {name} here, which ends the output (a stop token) "
                "before the constraint is complete: this output cannot be written")
    return (f"the constraint requires the text of the special token {name} here, which the tokenizer reads as "
            "that token, not as text: this output cannot be written")


_BITS = None  # int32 [32]: 1 << i


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bit masks int32 ``[R, ceil(V / 32)]`` (bit i of word w: token 32 w + i)
    -> bool ``[R, V]``."""
    global _BITS
    if _BITS is None:
        _BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)
    return (bitmask[:, :, None] & _BITS).ne(0).view(bitmask.shape[0], -1)[:, :vocab_size]


def _bit(row: torch.Tensor, token: int) -> bool:
    """Bit ``token`` of a bit mask int32 ``[W]``."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _set_bit(row: torch.Tensor, token: int, on: bool) -> None:
    """Set or clear bit ``token`` of a bit mask int32 ``[W]``, in place."""
    word = int(row[token >> 5]) & 0xFFFFFFFF
    word = word | (1 << (token & 31)) if on else word & ~(1 << (token & 31))
    row[token >> 5] = word - (1 << 32) if word >= 1 << 31 else word


def _masked_argmax(row_logits: torch.Tensor, bits: torch.Tensor, vocab_size: int) -> int:
    """The argmax of one row of logits ``[V]`` among the tokens of a bit mask int32 ``[W]``."""
    allowed = unpack_bitmask(bits[None], vocab_size)[0].to(row_logits.device)
    return int(row_logits.masked_fill(~allowed, float("-inf")).argmax())


class GrammarState:
    """One sequence's constraint: llguidance matchers over the sequence's committed tokens
    and the tokens a round tries past them (its drafts: the *path*).

    ``snaps[i]`` is a matcher after the committed tokens and ``path[:i]`` (llguidance's
    ``deep_copy`` costs about a microsecond, so no matcher is ever rolled back: that works
    for every grammar, ``max_tokens=`` lexemes included, and a token llguidance fails to
    consume leaves no broken matcher behind: it only counts as refused there). An EOS ends
    the path and is never given to a matcher; positions past an EOS are never masked
    (decoding stops at the EOS).

    Bit masks (int32 ``[W]``, :func:`unpack_bitmask`) are computed on the host where a
    position is decided and cached per path prefix until the next commit; whether one token
    is allowed is its bit (llguidance's ``validate_tokens`` is not the same test: it accepts
    tokenizations of forced text that the masks leave out).

    A constraint that cannot go on where the committed tokens stand (llguidance fails, or
    allows no token; compile-time checks catch most such grammars) does not raise: it
    allows the EOS only there and sets :attr:`failed`, so that the sequence ends at once and
    its decoder reports the error for that sequence alone.
    """

    def __init__(self, grammar: Grammar, device: torch.device | str):
        llg = _load_llguidance()
        matcher = on_grammar_stack(lambda: llg.LLMatcher(grammar.tokenizer, grammar.grammar, log_level=0))
        if matcher.is_error():
            raise OptionError(f"structured_output {grammar.spec.kind} is invalid: "
                              f"{_first_line(matcher.get_error(), grammar.spec.kind)}",
                              "structured_output")
        self.vocab_size, self.device = grammar.vocab_size, torch.device(device)
        self._words = (self.vocab_size + 31) // 32
        self.eos = frozenset(grammar.eos_token_ids)
        ids = grammar.checked_ids
        self._checked = (ids, ids >> 5, ids & 31)  # (the special tokens, their mask words and bits)
        self._token_text = grammar.token_text
        self.path: list[int] = []
        self.snaps = [matcher]
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}  # path prefix -> bit mask there (refusals cleared)
        self.ended = False  # the committed tokens end with an EOS
        self.failed: str | None = None  # why the constraint cannot go on (see the class docstring)
        # how many of the last commit's tokens lead to where the constraint is complete and allows only
        # an EOS (llguidance's matcher is stopped: e.g. a choice written whole that begins no other);
        # None where it can go on (see commit)
        self.complete_after: int | None = None
        self._last_error: str | None = None  # llguidance's reason for the last token it failed to consume
        self.dead: dict[tuple[int, ...], str] = {}  # path prefix -> why nothing can follow it (a dead end)
        # how many of the last verify block's drafts may be accepted (None: all): a draft after which
        # nothing can follow ends the round as its last token (see mask_greedy)
        self.draft_limit: int | None = None

    def _ended(self) -> bool:
        """Whether the path (else the committed tokens) ends with an EOS."""
        return self.path[-1] in self.eos if self.path else self.ended

    def _eos_row(self) -> torch.Tensor:
        row = torch.zeros(self._words, dtype=torch.int32)
        for t in self.eos:
            _set_bit(row, t, True)
        return row

    def _row(self) -> torch.Tensor | None:
        """The bit mask at the end of the path (cached); None past an EOS, where nothing is
        allowed, or where the path leads into a dead end: nothing can follow it (llguidance
        fails, or allows no token; the reason is kept in :attr:`dead`). A dead end is not
        avoided: where the committed tokens reach it, the sequence fails (:attr:`failed`), as
        target-only decoding, which looks no further than the committed tokens, fails there."""
        if self._ended():
            return None
        key = tuple(self.path)
        row = self.rows.get(key)
        error = None
        if row is None:
            matcher = self.snaps[-1]
            row = torch.empty(self._words, dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if matcher.is_error():
                error = _first_line(matcher.get_error())
                row.zero_()
            else:
                refused = self._check_special(row, matcher)
                if refused and not bool(row.any()):
                    error = special_refusal(*refused[0], self._token_text)
            self.rows[key] = row
        if key not in self.dead and not bool(row.any()):  # (also a row whose tokens were all refused since)
            self.dead[key] = error or self._last_error or "the constraint allows no token here"
        if key not in self.dead:
            return row
        if self.path:
            return None
        # where the committed tokens stand nothing can follow: the sequence ends (EOS only) with the error
        self.failed = self.dead.pop(key)
        self.rows[key] = row = self._eos_row()
        return row

    def _check_special(self, row: torch.Tensor, matcher) -> list[tuple[int, bool]]:
        """Clear the bits of the special tokens that bit mask ``row`` (int32 ``[W]``, just
        computed by ``matcher``) allows but the matcher cannot take there
        (:func:`refuse_special`); returns those refused. The check costs a lookup of the
        special tokens' bits per mask."""
        ids, words, bits = self._checked
        if not ids.numel():
            return []
        return refuse_special(row, matcher, ids[(row[words] >> bits) & 1 == 1].tolist(), self.eos)

    def _refuse(self, token: int) -> None:
        """The path's last token is refused where it stands: its bit is cleared in the mask
        there (computed when the token was allowed; in place: a verify block holding this row
        sees it too); the token and the mask after it are dropped."""
        _set_bit(self.rows[tuple(self.path[:-1])], token, False)
        self.rows.pop(tuple(self.path), None)
        self.dead.pop(tuple(self.path), None)
        self._rewind(len(self.path) - 1)

    def _unpack(self, row: torch.Tensor) -> torch.Tensor:
        return unpack_bitmask(row[None], self.vocab_size)[0].to(self.device)

    def allows(self, token: int) -> bool:
        """Whether the grammar allows ``token`` at the end of the path."""
        if self._ended() or not 0 <= token < self.vocab_size:
            return False
        row = self._row()  # (the mask, not validate_tokens: llguidance's masks leave out non-canonical
        return row is not None and _bit(row, token)  # tokenizations of forced text that validate_tokens accepts)

    def advance(self, token: int) -> bool:
        """Extend the path by ``token`` if the grammar allows it there (else nothing changes).
        Returns whether it did."""
        if not self.allows(token):
            return False
        if token not in self.eos:
            matcher = self.snaps[-1].deep_copy()
            if not matcher.consume_token(token) or matcher.is_error():
                self._last_error = _first_line(matcher.get_error())
                self.path.append(token)
                self._refuse(token)
                return False
            self.snaps.append(matcher)
        self.path.append(token)
        return True

    def next_allowed(self) -> torch.Tensor | None:
        """bool ``[V]`` on the device: the tokens allowed at the end of the path; None past
        an EOS (or where nothing is allowed): any token."""
        row = self._row()
        return None if row is None else self._unpack(row)

    def _rewind(self, n: int) -> None:
        """Cut the path to its first ``n`` tokens."""
        if n < len(self.path):
            del self.path[n:]
            del self.snaps[n + 1:]

    def masks(self, draft: Sequence[int] = ()) -> torch.Tensor:
        """The masks of a verify block ``[t0, d_1 .. d_{R-1}]``: bool ``[R, V]`` on the device,
        row j the tokens allowed after the committed tokens and ``d_1 .. d_j``; rows past a
        draft token the grammar refuses, past an EOS, or past a draft that leads into a dead
        end, are all True (positions no committed token reaches: acceptance stops at the
        refused token, decoding at the EOS, and :attr:`draft_limit` before the dead-ending draft)."""
        draft = [int(t) for t in draft]
        self._rewind(0)
        self.draft_limit = None
        rows = []
        for j in range(len(draft) + 1):
            row = self._row()
            if row is None:
                if not self._ended():  # d_j leads into a dead end: it can end the round, not be accepted
                    self.draft_limit = j - 1
                break
            rows.append(row)
            if j == len(draft) or not self.advance(draft[j]):
                break
        known = unpack_bitmask(torch.stack(rows), self.vocab_size) if rows else torch.ones(0, self.vocab_size, dtype=torch.bool)
        if known.shape[0] <= len(draft):
            known = torch.cat([known, known.new_ones(len(draft) + 1 - known.shape[0], self.vocab_size)])
        return known.to(self.device)

    def mask_greedy(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """Greedy decoding's masks of a verify block, computed only where they change a
        decision: ``logits`` float32 ``[R, V]`` (processed, row j after ``d_1 .. d_j``) ->
        float32 ``[R, V]`` whose argmax rows equal those of the fully masked logits up to
        the first row whose choice differs from the draft (greedy acceptance reads no
        further). Row j is masked only where the grammar refuses its argmax (the argmax of
        the masked row is then a different token); elsewhere the argmax is allowed, so it
        is also the masked argmax (the first index of the maximum either way). Each chosen
        token is consumed on the way (the path ends with the round's tokens, which the
        commit then finds there); one llguidance fails to consume counts as refused and its
        row is decided again. A draft after which nothing can follow (a dead end) sets
        :attr:`draft_limit`: it can be the round's last token, so no decision is made past
        it (target-only decoding commits it and then fails). Returns
        ``logits`` itself when no row is masked."""
        draft = [int(t) for t in draft]
        choices = logits.argmax(dim=-1).tolist()
        self._rewind(0)
        self.draft_limit = None
        masked: dict[int, torch.Tensor] = {}  # row -> its bit mask (refusals cleared in place)
        j = 0
        while j <= len(draft) and not self._ended():  # (past an accepted EOS decoding stops)
            choice = choices[j]
            while not self.advance(choice):  # refused: decide the row on its mask
                row = self._row()
                if row is None:  # (j >= 1: at the committed tokens a dead end fails, with an EOS row)
                    self.draft_limit = j - 1  # d_j leads into a dead end: row j - 1's choice ends the round
                    break
                masked[j] = row
                choice = _masked_argmax(logits[j], row, self.vocab_size)
            else:
                if j < len(draft) and choice == draft[j]:
                    j += 1
                    continue
            break
        if not masked:
            return logits
        out = logits.clone()
        for j, row in masked.items():
            out[j].masked_fill_(~self._unpack(row), float("-inf"))
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """The round committed ``tokens`` (in order): the committed state moves past them and
        the next round starts with an empty path (the masks past them kept). Tokens
        after an EOS (where decoding stops) are not consumed; a token the constraint does not
        allow there (none should be: every decision is made on masked logits) sets :attr:`failed`.
        Sets :attr:`complete_after`: the number of ``tokens`` before their EOS (all where none)
        when after them the constraint allows only an EOS, else None."""
        tokens = [int(t) for t in tokens]
        common = 0
        while common < min(len(tokens), len(self.path)) and tokens[common] == self.path[common]:
            common += 1
        self._rewind(common)
        for t in tokens[common:]:
            if self._ended() or self.failed is not None:
                break
            if not self.advance(t):
                self.failed = self._last_error or f"committed token {t} is not allowed by the constraint"
        k, path = len(self.path), tuple(self.path)
        self.ended = self._ended()
        # (a stopped matcher takes nothing but an EOS; the EOS that may end the path is not the matcher's)
        stopped = self.failed is None and self.snaps[-1].is_stopped()
        self.complete_after = (k - 1 if self.ended and k else k) if stopped else None
        self.rows = {key[k:]: row for key, row in self.rows.items() if key[:k] == path}
        self.dead = {key[k:]: why for key, why in self.dead.items() if key[:k] == path}
        self.snaps = [self.snaps[-1]]
        self.path = []
