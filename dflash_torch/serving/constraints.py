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
from urllib.parse import unquote

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


# What strict_schema reads of an object schema. Keywords that allow or demand keys of the object
# the schema is applied to (or describe its items): beside them, a branch's or a definition's "exactly
# my declared keys" could refuse keys the others declare (or make the schema unsatisfiable), and its
# objects inside could be closed to other keys than those the others give the same property or item,
# so neither is closed.
_KEYED = frozenset({"properties", "patternProperties", "additionalProperties", "unevaluatedProperties", "required",
                    "dependentRequired", "dependentSchemas", "dependencies", "minProperties", "allOf", "anyOf",
                    "oneOf", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef", "enum", "const",
                    "items", "prefixItems", "additionalItems", "contains", "unevaluatedItems"})
# keywords whose subschemas describe the schema's own instance: beside them, the parts of that instance
# (a property's value, an item) may be described by another schema too, so the schemas of them are open
_SAME_VALUE = ("$ref", "$dynamicRef", "$recursiveRef", "allOf", "anyOf", "oneOf", "then", "else",
               "dependentSchemas", "dependencies")
# keywords that share the object with other schemas (or say what other keys it takes): not closed beside them
_SHARING = (*_SAME_VALUE, "additionalProperties", "unevaluatedProperties", "if")
# subschemas of a new instance (a property's value, an item, ...): closed or not on their own
_NEW_VALUE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "unevaluatedItems",
              "unevaluatedProperties", "items")
_NEW_VALUE_LISTS = ("prefixItems", "items")
_DEFINITIONS = ("$defs", "definitions")


def _says_object(schema: dict) -> bool:
    """Whether ``schema`` describes an object: its ``type`` is (or lists) ``object``, or it names
    no type and has ``properties``."""
    kind = schema.get("type")
    if kind is None:
        return isinstance(schema.get("properties"), dict)
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _keyed(schema: dict, but: str) -> bool:
    """Whether ``schema`` has a keyword (other than ``but``) that allows or demands keys."""
    return any(key in schema for key in _KEYED if key != but)


def _closable(schema: dict, is_object: bool) -> bool:
    """Whether ``schema``, in a position of its own, takes exactly its declared keys with
    ``additionalProperties: false`` and nothing else: an object's schema (or ``is_object``) with a
    ``properties`` dict, no keyword that shares the object (:data:`_SHARING`), no ``enum``,
    ``const`` or ``not``, and no key it requires (``required``, ``dependentRequired``,
    ``minProperties``) beyond those declared."""
    props = schema.get("properties")
    if not isinstance(props, dict) or not (is_object or _says_object(schema)):
        return False
    if any(key in schema for key in _SHARING) or any(key in schema for key in ("enum", "const", "not")):
        return False  # (an enum's or a const's object may hold other keys; not: what it refuses may be all else)
    required = schema.get("required", [])
    dependent = schema.get("dependentRequired", {})
    names = [*(required if isinstance(required, list) else []),
             *(n for v in (dependent.values() if isinstance(dependent, dict) else ()) if isinstance(v, list) for n in v)]
    least = schema.get("minProperties", 0)
    return all(n in props for n in names) and not (isinstance(least, (int, float)) and least > len(props))


def _pointer(ref: str) -> tuple[str, ...] | None:
    """The path of a local JSON pointer ``$ref`` (``#`` or ``#/a/b``, ``~1`` / ``~0`` and ``%XX``
    escapes read), else None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    return tuple(unquote(part).replace("~1", "/").replace("~0", "~") for part in ref[2:].split("/")) if ref != "#" else ()


class _Walk:
    """The object schemas of a schema document and whether each is open (its object may hold
    keys another schema declares: in an open position, or inside a schema whose instance another
    schema may describe too), walked as :func:`strict_schema` reads them."""

    def __init__(self, root):
        self.root = root
        self.open: dict[tuple, bool] = {}  # path -> open (a schema reached both ways is open)
        self.nodes: dict[tuple, dict] = {}
        self.lost = False  # a $ref in an open position whose target is not found
        self.named: list[tuple[tuple, dict]] = []  # definitions and $ref targets, anchored / $id'd schemas

    def target(self, ref: str):
        """``(path, schema)`` of a local ``$ref``, else None."""
        path = _pointer(ref)
        if path is None:
            return None
        node, out = self.root, []
        for part in path:
            if isinstance(node, dict) and part in node:
                node = node[part]
                out.append(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                out.append(int(part))
            else:
                return None
        return (tuple(out), node) if isinstance(node, dict) else None

    def visit(self, path: tuple, schema, open_: bool) -> None:
        if not isinstance(schema, dict):
            return
        seen = self.open.get(path)
        if seen is not None and (seen or not open_):
            return  # (visited as open, or as closed again)
        self.open[path], self.nodes[path] = open_, schema
        if path and ("$id" in schema or "$anchor" in schema):
            self.named.append((path, schema))
            self.lost = self.lost or "$id" in schema  # (local $refs below it are read against it)
        # the parts of this instance (its properties' values, items, ...): open where another schema may
        # describe them too, as this one is open or has a keyword that applies another schema to it
        parts_open = open_ or any(key in schema for key in _SAME_VALUE)
        for key in _NEW_VALUE:
            self.visit((*path, key), schema.get(key), parts_open)
        for key in _NEW_VALUE_LISTS:
            for i, s in enumerate(schema.get(key) if isinstance(schema.get(key), list) else ()):
                self.visit((*path, key, i), s, parts_open)
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
        # (a key both may describe: both open; whether a regex matches a name is not tried, as a request's
        # regex could take exponential time in Python's engine)
        overlap = bool(props) and bool(patterns)
        for name, s in props.items():
            self.visit((*path, "properties", name), s, parts_open or overlap)
        for pattern, s in patterns.items():
            self.visit((*path, "patternProperties", pattern), s, parts_open or overlap)
        for key in _DEFINITIONS:
            for name, s in (schema.get(key).items() if isinstance(schema.get(key), dict) else ()):
                if isinstance(s, dict):
                    self.named.append(((*path, key, name), s))
                self.visit((*path, key, name), s, False)
        # (subschemas applied to this same object: open; "if" and "not" are conditions, left as they are)
        for key in ("then", "else"):
            self.visit((*path, key), schema.get(key), True)
        for key in ("dependentSchemas", "dependencies"):
            for name, s in (schema.get(key).items() if isinstance(schema.get(key), dict) else ()):
                self.visit((*path, key, name), s, True)
        for key in ("allOf", "anyOf", "oneOf"):
            # a branch is closed only where the object has no keys but the branch's: a plain union, or an
            # allOf of one branch alone (a wrapper, as pydantic v1 writes a $ref with a description)
            branches = schema.get(key) if isinstance(schema.get(key), list) else []
            branch_open = open_ or _keyed(schema, key) or (key == "allOf" and len(branches) > 1)
            for i, s in enumerate(branches):
                self.visit((*path, key, i), s, branch_open)
        ref = schema.get("$ref")
        if isinstance(ref, str):
            ref_open = open_ or _keyed(schema, "$ref")
            found = self.target(ref)
            if found is None:
                self.lost = self.lost or ref_open
            else:
                self.named.append(found)
                self.visit(*found, ref_open)


def _with_closed(schema, closed: dict):
    """``schema`` with ``additionalProperties: false`` added to the object schemas at the paths
    of ``closed`` (a trie: a path's part -> the trie below it; the key None ends a path there);
    each container on the way copied once, ``schema`` itself not changed."""
    out = list(schema) if isinstance(schema, list) else dict(schema)
    for part, below in closed.items():
        if part is None:
            out["additionalProperties"] = False
        else:
            out[part] = _with_closed(schema[part], below)
    return out


def strict_schema(schema, is_object: bool = False):
    """``schema`` (a JSON schema: a dict, or a bool, returned as is) as OpenAI's ``strict: true``
    reads it: an object holds exactly the keys its schema declares. An object schema gets
    ``additionalProperties: false`` when all of these hold, so that the rewrite never refuses
    what "exactly the declared keys" allows nor makes a satisfiable schema unsatisfiable:

    * it describes an object (its ``type`` is or lists ``object``, or it names no type and has
      ``properties``; the root always where ``is_object``: a tool's ``parameters``) and has a
      ``properties`` dict (an object schema without one is free-form: left open);
    * it says none of ``additionalProperties`` (an explicit value, true or a schema, is kept),
      ``unevaluatedProperties``, ``$ref``, ``allOf``, ``anyOf``, ``oneOf``, ``if`` / ``then`` /
      ``else``, ``dependentSchemas``, ``dependencies`` (its object takes keys other schemas
      declare), nor ``enum``, ``const``, ``not``, and requires no key (``required``,
      ``dependentRequired``, ``minProperties``) beyond those it declares
      (``patternProperties``' keys are still allowed);
    * it is not in an open position: a ``then`` / ``else`` / ``dependentSchemas`` /
      ``dependencies`` subschema, a branch of an ``allOf`` of several, an ``anyOf`` / ``oneOf``
      branch or the one branch of an ``allOf`` of a schema that is in an open position or has
      another keyword that allows or demands keys or describes items (``properties``,
      ``required``, ``patternProperties``, ``additionalProperties``, ``$ref``, ``allOf``,
      ``enum``, ``items``, ...: a plain union, as pydantic writes an ``Optional`` or a
      discriminated union, has its branches closed, as has a lone ``allOf`` wrapper), nor the
      target of a ``$ref`` that is in an open position or beside such a keyword (followed
      through chains of ``$ref``: a target reached once from an open position is open
      everywhere);
    * it is not inside a schema whose instance another schema may describe too (openness
      propagates down, as the other schema may describe the same property or item): not a
      value of ``properties`` / ``patternProperties`` / ``additionalProperties``, nor
      ``items`` / ``prefixItems`` / ``additionalItems`` / ``contains`` (nor a ``$ref`` target
      reached from them), at any depth, of a schema in an open position or with ``$ref``,
      ``allOf``, ``anyOf``, ``oneOf``, ``then`` / ``else``, ``dependentSchemas`` or
      ``dependencies``; nor a value of ``properties`` or of ``patternProperties`` in a schema
      that has both (a regex may match a declared name: whether it does is not tried, as a
      request's regex could take exponential time in Python's regex engine).

    The object schemas looked at: the root, the values of ``properties`` / ``patternProperties``
    / ``additionalProperties``, ``items`` / ``prefixItems``, ``$defs`` / ``definitions``, the
    branches above, and the targets of local ``$ref`` JSON pointers (``#`` and ``#/...``, with
    ``~0`` / ``~1`` / ``%XX`` escapes) wherever they are (``#/components/schemas/X`` too), at
    any depth; ``if`` and ``not`` are conditions, left as they are. Where a ``$ref`` in an open
    position names nothing found so (an ``$anchor``, another document), or a schema below the
    root has an ``$id`` (local pointers below it are read against it), every definition,
    ``$ref`` target and schema with an ``$id`` or ``$anchor`` is left open. ``enum``,
    ``const``, ``default`` and other values are data, left as they are. A new schema;
    ``schema`` is not changed (the parts not rewritten are shared with it).

    Raises:
        DFlashError: the schema is nested too deeply to walk (Python's recursion limit)."""
    if not isinstance(schema, dict):
        return schema
    try:
        walk = _Walk(schema)
        walk.visit((), schema, False)
        i = 0
        while walk.lost and i < len(walk.named):  # (the list grows as the open ones are walked again)
            walk.visit(*walk.named[i], True)
            i += 1
        closed: dict = {}
        for path, open_ in walk.open.items():
            if not open_ and _closable(walk.nodes[path], is_object and not path):
                below = closed
                for part in path:
                    below = below.setdefault(part, {})
                below[None] = True
        return _with_closed(schema, closed) if closed else schema
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
