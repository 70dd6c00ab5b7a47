"""A chat request's structured output, as the server hands it to the engine.

* **After the reasoning** (:func:`after_reasoning`): when the chat template opened a
  ``<think>`` in the prompt (Qwen3.5's thinking mode; the reply is reasoning up to
  ``</think>``, then the answer: :class:`~.reasoning.ThinkParser`), the request's constraint
  applies to the answer, not to the reasoning, as vLLM does: the reply is constrained to
  any text up to the first ``</think>`` (:func:`reasoning_rules`), then, right after it,
  exactly what the constraint allows, so ``content`` is the constrained output and
  ``reasoning_content`` the thinking. Where the template neither opened nor closed a
  reasoning (Qwen3's thinking mode, whose model writes ``<think>`` itself), the reply may
  open one first (``<think>``, any text up to ``</think>``), or start with the constraint's
  output (:func:`reasoning_start`). The constraint is embedded in one llguidance Lark
  grammar: a JSON schema with ``%json`` (with the engine's JSON defaults,
  :data:`~dflash_torch.structured.JSON_DEFAULTS`, unless the schema has its own
  ``x-guidance``), ``json_object`` as the schema ``{"type": "object"}``, a regex as a
  ``/.../`` terminal (llguidance's own escaping, :func:`llguidance.regex_to_lark`), a choice
  as an alternation of string literals, a Lark grammar as a nested ``%lark { ... }`` grammar
  (its rules, terminals and ``%ignore`` stay its own).
* **Whitespace** (:func:`with_whitespace`): vLLM's ``guided_whitespace_pattern`` (or
  ``structured_outputs.whitespace_pattern``) is the JSON's whitespace between tokens
  (llguidance's ``x-guidance`` ``whitespace_pattern``) of a JSON schema or ``json_object``
  constraint.

``</think>`` may be text (several tokens) or one token of the tokenizer: llguidance reads a
tokenizer's added tokens as special tokens, which text in a grammar never matches, so such
a token is named in the grammar by its id (``<[id]>``, :func:`think_tokens`); ``<think>`` alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from ..errors import DFlashError
from ..structured import JSON_DEFAULTS, StructuredOutput
from .reasoning import THINK_CLOSE, THINK_OPEN

_CLOSE_REGEX = THINK_CLOSE.replace("/", "\\/")  # (in a /.../ terminal)


def reasoning_rules(end_token: int | None = None) -> str:
    """Lark rules of ``reasoning_rest``: any text up to and with the first ``</think>`` (lazy:
    it ends there), written as text or, when ``end_token`` is given, as that token (the
    tokenizer's one token for ``</think>``, :func:`think_end_token`)."""
    text_end = f"/(?s:.*){_CLOSE_REGEX}/"
    if end_token is None:
        return f"reasoning_rest[lazy]: {text_end}\n"
    return (f"reasoning_rest: reasoning_end | reasoning_text <[{int(end_token)}]>\n"
            f"reasoning_end[lazy]: {text_end}\n"
            "reasoning_text: /(?s:.*)/\n")


def special_token(hf_tokenizer, llg_tokenizer, text: str) -> int | None:
    """The id of ``text`` where the tokenizer has it as one token that llguidance takes for a
    special token (an added token, as ``</think>`` and ``<tool_call>`` are in Qwen3's
    tokenizer), else None (the text form matches it)."""
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or not llg_tokenizer.is_special_token(ids[0]):
        return None
    return int(ids[0])


def think_tokens(hf_tokenizer, llg_tokenizer) -> tuple[int | None, int | None]:
    """:func:`special_token` of ``<think>`` and of ``</think>``."""
    return special_token(hf_tokenizer, llg_tokenizer, THINK_OPEN), special_token(hf_tokenizer, llg_tokenizer, THINK_CLOSE)


def text_or_token(text: str, token: int | None) -> str:
    """A Lark expression matching ``text`` written out, or, when ``token`` is given (its
    :func:`special_token`), that one token too."""
    return json.dumps(text) if token is None else f"({json.dumps(text)} | <[{int(token)}]>)"


# keywords whose value is a schema, a list of schemas, or an object of schemas (by name)
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def _says_object(schema: dict) -> bool:
    """Whether ``schema`` describes an object: its ``type`` is (or lists) ``object``, or it names
    no type and has ``properties``."""
    kind = schema.get("type")
    if kind is None:
        return isinstance(schema.get("properties"), dict)
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _declared(schema) -> list[str]:
    """The property names ``schema`` (a dict, else none) declares in its ``properties``."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    return list(props) if isinstance(props, dict) else []


def _strict(schema, is_object: bool = False, keys: tuple[str, ...] = ()):
    """:func:`strict_schema` of ``schema``; ``keys``: names its object also takes (an ``allOf``
    branch's: those its siblings declare)."""
    if not isinstance(schema, dict):
        return schema
    out, shared = dict(schema), ()
    branches = schema.get("allOf")
    if isinstance(branches, list) and len(branches) > 1:
        # (an allOf's objects are intersected: each takes the keys the others declare too, any value,
        # so that the object holds exactly the keys declared across them, not only those all declare)
        shared = tuple(dict.fromkeys(_declared(schema) + [k for b in branches for k in _declared(b)]))
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, keys=shared if key == "allOf" else ()) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s) for name, s in out[key].items()}
    if "$ref" in out and not isinstance(out.get("properties"), dict):
        return out  # (the definition it names declares the keys, and is closed where it is)
    if is_object or _says_object(out):
        return _closed(out, (*keys, *shared))
    return out


def _closed(schema: dict, keys=()) -> dict:
    """``schema`` (an object's) with ``additionalProperties`` false where it does not say, and
    each of ``keys`` it does not declare as a property of any value."""
    if "additionalProperties" in schema:
        return schema
    props = dict(schema["properties"]) if isinstance(schema.get("properties"), dict) else {}
    for key in keys:
        props.setdefault(key, {})
    return {**schema, "properties": props, "additionalProperties": False}


def strict_schema(schema, is_object: bool = False):
    """``schema`` (a JSON schema: a dict, or a bool, returned as is) as OpenAI's ``strict: true``
    reads it: an object holds exactly the keys its schema declares. Every object schema in it
    (:func:`_says_object`: the root, ``properties``' values, ``items``, ``$defs`` /
    ``definitions``, ``anyOf`` / ``oneOf`` / ``allOf`` branches, ... at any depth) that does not
    say ``additionalProperties`` gets ``additionalProperties: false`` (an explicit value, true or a
    schema, is kept); an object of several ``allOf`` branches holds the keys they declare between
    them (each branch and the object itself take the others' keys, any value: the branches'
    own schemas still hold them; a branch that is a ``$ref`` adds no keys: its definition is
    closed on its own). A schema that is a ``$ref`` without ``properties`` of its own is left
    open: the definition it names is closed (a root ``$ref``, as zod-to-json-schema writes a
    tool's ``parameters``). ``is_object``: the root is an object's schema even where it does not
    say so (a tool's ``parameters``). ``enum``, ``const``, ``default`` and other values are
    data, left as they are. A new schema; ``schema`` is not changed.

    Raises:
        DFlashError: the schema is nested too deeply to walk (Python's recursion limit)."""
    try:
        return _strict(schema, is_object)
    except RecursionError:
        raise DFlashError("the schema is nested too deeply to make strict") from None


def _json_schema(spec: StructuredOutput) -> Mapping:
    """The JSON schema of a ``json`` or ``json_object`` constraint."""
    return spec.json if spec.kind == "json" else {"type": "object"}


def with_whitespace(spec: StructuredOutput, pattern: str) -> StructuredOutput:
    """``spec`` (a ``json`` or ``json_object`` constraint) with ``pattern`` (a regex) as the
    whitespace between JSON tokens: the schema's ``x-guidance`` ``whitespace_pattern`` (its
    other ``x-guidance`` options kept)."""
    schema = dict(_json_schema(spec))
    own = schema.get("x-guidance")
    schema["x-guidance"] = {**(own if isinstance(own, Mapping) else {}), "whitespace_pattern": pattern}
    return StructuredOutput(json=schema)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # (Lark string literals take JSON's escapes)


def constraint_rule(spec: StructuredOutput) -> str:
    """The Lark rule ``constraint`` whose language is ``spec`` 's."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = _json_schema(spec)
        if "x-guidance" not in schema:  # (as StructuredOutput compiles a schema without its own options)
            schema = {**schema, "x-guidance": dict(JSON_DEFAULTS)}
        return f"constraint: %json {json.dumps(schema)}\n"
    if kind == "regex":
        from llguidance import regex_to_lark

        return f"constraint: /{regex_to_lark(spec.regex)}/\n"
    if kind == "choice":
        return "constraint: " + " | ".join(_lark_string(c) for c in spec.choice) + "\n"
    return "constraint: %lark {\n" + spec.grammar + "\n}\n"


def reasoning_start(reasoning: str | None, think_tokens: tuple[int | None, int | None] = (None, None),
                    gap: str = "") -> tuple[str, str]:
    """``(expression, rules)``: the Lark expression a constrained reply starts with, and the
    rules it uses. ``reasoning``: ``"opened"``, the template opened a ``<think>`` in the
    prompt: the rest of that reasoning up to ``</think>`` (:func:`reasoning_rules`);
    ``"optional"``, the reply may open one (``<think>`` first, as Qwen3's thinking mode
    writes it) and close it; None: nothing. ``think_tokens``: the tokenizer's one token for
    ``<think>`` and for ``</think>`` (:func:`special_token`, None: text); ``gap``: an
    expression after the reasoning (e.g. a few whitespace characters)."""
    if reasoning is None:
        return "", ""
    think_open, think_end = think_tokens
    rules = reasoning_rules(think_end)
    if reasoning == "opened":
        return f"reasoning_rest {gap}", rules
    return f"(reasoning {gap})? ", f"reasoning: {text_or_token(THINK_OPEN, think_open)} reasoning_rest\n" + rules


def after_reasoning(spec: StructuredOutput, reasoning: str = "opened",
                    think_tokens: tuple[int | None, int | None] = (None, None)) -> StructuredOutput:
    """A grammar of a reply that starts inside a reasoning (``reasoning`` ``"opened"``: the
    rest of it up to ``</think>``) or may open one (``"optional"``), then, right after it
    (or from the start), an output of ``spec`` (:func:`reasoning_start`)."""
    start, rules = reasoning_start(reasoning, think_tokens)
    return StructuredOutput(grammar=f"start: {start}constraint\n" + constraint_rule(spec) + rules)
