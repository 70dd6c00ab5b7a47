"""Find the tool calls in a chat reply as text arrives, for the server's
``message.tool_calls`` (OpenAI's function calling), and the text outside them (``content``).

Formats (``serve --tool-call-parser``):

* ``hermes`` (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``
  blocks, any number of them.
* ``qwen3_coder`` (Qwen3-Coder, Qwen3.5, Qwen3.6): ``<tool_call>\\n<function=NAME>\\n
  <parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`` blocks. A value is
  text, unless the tool's JSON schema types the parameter ``integer``, ``number``,
  ``boolean``, ``null``, ``object`` or ``array``: then it is that JSON value when it parses as one
  (else the text).
  A ``</parameter>`` inside a value is taken as text (a value ends at the ``</parameter>`` that
  the next ``<parameter=`` or the ``</function>`` follows).
* ``glm45`` (GLM-4.5, GLM-4.6) and ``glm47`` (GLM-4.7, GLM-5, GLM-5.1):
  ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>``
  blocks, any number of them; GLM-4.7 / 5 write no newlines (``<tool_call>NAME<arg_key>...``,
  the calls one right after the other). One parser reads both (:class:`Glm45Parser`): a
  value is typed by the tool's schema as for ``qwen3_coder`` (the JSON value of a type
  other than string it allows, when it parses as one; else the text as written); a value
  of a parameter the schema does not describe is its JSON value where it parses as JSON,
  else the text (GLM's templates write strings as they are, other values as ``tojson``).
  The two names differ only in the layout of forced calls.
* ``gemma4`` (Gemma 4): ``<|tool_call>call:NAME{ARGUMENTS}<tool_call|>`` blocks, any number
  of them, the arguments in Gemma's own notation: ``key:value`` pairs split by commas, keys
  bare, strings between ``<|"|>`` markers, objects in ``{}``, lists in ``[]``, other values
  bare (``true``, ``false``, ``null``, numbers; any other bare text is a string).
* ``minimax_m2`` (MiniMax-M2, M2.1, M2.5): ``<minimax:tool_call>\n<invoke name="NAME">\n
  <parameter name="KEY">VALUE</parameter>\n...</invoke>\n...</minimax:tool_call>`` blocks,
  each holding one or more calls (names quoted with ``"`` or ``'``, or bare), read as
  MiniMax's guide reads them (:class:`MiniMaxM2Parser`): text between calls is ignored, a
  value loses its surrounding whitespace and is typed by the tool's schema.
* ``kimi_k2`` (Kimi-K2, K2.5): a ``<|tool_calls_section_begin|>`` ... ``<|tool_calls_section_end|>``
  section holding one or more calls ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>`` (:class:`KimiK2Parser`); a call's ``id`` is its header
  ``functions.NAME:IDX``, as Kimi's template writes a call back.
* ``deepseek_v31`` (DeepSeek-V3.1; V3 and R1 too): a ``<｜tool▁calls▁begin｜>`` ...
  ``<｜tool▁calls▁end｜>`` section (fullwidth bars, ``▁`` for spaces) holding one or more calls
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, or as V3 / R1 write them
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>``
  (:class:`DeepSeekV31Parser`).
* ``harmony`` (gpt-oss): a message whose recipient is ``functions.NAME``
  (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``;
  the recipient may also follow the role, ``<|start|>assistant to=functions.NAME``). Its
  body is the arguments; it ends at ``<|call|>`` (or ``<|end|>``, ``<|return|>``), or at
  the reply's end when the reply ended with a stop token (``<|call|>`` is one of gpt-oss's
  EOS tokens, so it is not in the text).

A call whose arguments are not a JSON object (strict JSON: no NaN or Infinity, no number
beyond a float's range, at most :data:`MAX_DEPTH` objects or lists deep), whose name is
empty or blank (no function has one: ``{"name": ""}``), or that is still
open when the reply is cut (``max_tokens``), stays in the content as the model wrote it (for
harmony: its body), so no text is lost; in the formats of sections of calls (MiniMax, Kimi,
DeepSeek), a section with such a call stays content whole. In the marked-block formats
(``<tool_call>``, ``<|tool_call>``, the sections), a close marker after which the call does
not parse may be text inside an argument: the call is read on to the next close marker
(unless an open marker comes first), so the text after a malformed call is held back until
that is known. In the ``<tool_call>`` formats and the sections, whitespace next to a call (the newlines templates put between calls) is dropped,
except that text before and after calls stays apart (the first whitespace next to the calls
between them, e.g. ``"Sure.\n<call>\nDone."`` gives ``"Sure.\nDone."``);
Gemma 4's calls sit inside the text, which keeps its spaces.

Composition with :mod:`.reasoning`: a reply is first split into reasoning and answer by
the reasoning parser, and the tool calls are looked for in the answer
(:class:`ReplyParser`): a Qwen3 / Qwen3.5 reply thinks, then calls. Harmony carries both in
one message structure, so one parser, :class:`HarmonyToolParser` (the reasoning module's
:class:`~.reasoning.HarmonyParser` that also reads recipients), does both.

``tool_choice`` ``required`` or a named function (hermes, qwen3_coder, glm45, glm47, kimi_k2,
deepseek_v31): :func:`hermes_grammar`, :func:`qwen3_coder_grammar`, :func:`glm45_grammar`,
:func:`glm47_grammar`, :func:`kimi_k2_grammar` and :func:`deepseek_v31_grammar` (V3.1's layout)
are llguidance grammars that constrain the reply to the calls
themselves, written as the model's chat template writes them (structured outputs,
:mod:`dflash_torch.structured`), so that the parser above reads them.

Parsers are fed the reply in pieces and return what each piece adds; text that may still
become a marker is held back until it cannot. The result does not depend on where the
pieces were cut.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

from ..errors import DFlashError
from ..options import JSON_TYPES, check_choice, tool_name_error
from .constraints import reasoning_start, strict_schema, text_or_token
from .reasoning import HarmonyParser, ReasoningParser, _held, new_parser

PARSERS = ("auto", "none", "hermes", "qwen3_coder", "glm45", "glm47", "minimax_m2", "gemma4", "kimi_k2", "deepseek_v31",
           "harmony")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MINIMAX_CALL_OPEN, MINIMAX_CALL_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'


@dataclass
class ToolCall:
    """One call the model wrote: the function's ``name`` and its ``arguments`` as JSON text
    (an object). ``id``: OpenAI's ``call_<random>``."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


MAX_DEPTH = 100  # objects and lists nested in one call's arguments (deeper: a malformed call)


class _BigNumber:
    """A JSON number beyond a float's range (``1E400``: valid JSON, which a grammar-forced call
    may hold), kept as its text: :func:`_dumps` writes it back as it was (``json.dumps`` would
    write the float's inf as ``Infinity``, which is not JSON)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _json(text: str):
    """``json.loads`` of strict JSON: NaN and Infinity, and objects or lists nested more than
    :data:`MAX_DEPTH` deep, are refused; a number beyond a float's range is a :class:`_BigNumber`.

    Raises:
        ValueError: text that is not such JSON, or nested too deeply to read (a RecursionError).
    """
    def finite(number: str) -> float | _BigNumber:
        value = float(number)
        return value if math.isfinite(value) else _BigNumber(number)

    def constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_float=finite, parse_constant=constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    pending = [(value, 0)]  # (deeper than MAX_DEPTH: writing it back could exhaust the stack)
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ValueError("nested too deeply")
            pending.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


def _json_object(text: str) -> dict | None:
    try:
        value = _json(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# a UTF-16 surrogate code point: in a str that JSON's "\\ud83d" escape made, one with no pair (Python's
# json joins an escaped pair into its character), which UTF-8 cannot encode
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """``text`` (JSON text) with each lone surrogate written as its ``\\uXXXX`` escape, so that
    it encodes to UTF-8 and reads back as the same value; unchanged where it has none. (A
    surrogate in JSON text can only be inside a string, where the escape means it.)"""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def json_text(obj, **kwargs) -> str:
    """``json.dumps(obj, ensure_ascii=False, **kwargs)`` with any lone surrogate escaped
    (:func:`escape_surrogates`): the JSON text of a server response, which must encode to UTF-8.

    Raises:
        TypeError, ValueError: as ``json.dumps`` (an object that is not JSON data)."""
    return escape_surrogates(json.dumps(obj, ensure_ascii=False, **kwargs))


def _dumps(obj) -> str:
    """JSON text of ``obj`` (characters as they are, but a lone surrogate, which a model's JSON
    may spell as ``"\\ud83d"``, as that escape: :func:`escape_surrogates`); a :class:`_BigNumber`
    as its own text."""
    numbers, nonce = [], uuid.uuid4().hex  # (a string of obj dumps to a placeholder only by guessing it)

    def placeholder(value) -> str:
        if not isinstance(value, _BigNumber):
            raise TypeError(f"{type(value).__name__} is not JSON")
        numbers.append(value.text)
        return f"{nonce}:{len(numbers) - 1}"

    text = json_text(obj, default=placeholder)
    for i, number in enumerate(numbers):
        text = text.replace(f'"{nonce}:{i}"', number, 1)
    return text


def _named(call: ToolCall | list[ToolCall] | None) -> ToolCall | list[ToolCall] | None:
    """A block's call(s) as :meth:`ToolParser.parse_block` read them, or None (malformed: the
    block stays text) where a call's name is empty or blank, which names no function (a tool's
    name never is: :func:`~dflash_torch.options.tool_name_error`)."""
    calls = call if isinstance(call, list) else [call] if call is not None else []
    return None if any(tool_name_error(c.name) is not None for c in calls) else call


class ToolParser:
    """Base of the formats of marked blocks (``OPEN`` ... ``CLOSE``, ``<tool_call>`` unless a
    subclass says otherwise): ``feed`` the answer's text, get back the content and the calls
    it completes; :meth:`parse_block` reads one block's inside."""

    OPEN, CLOSE = CALL_OPEN, CALL_CLOSE
    # whitespace next to a call (the newlines templates put between calls) is dropped, except
    # that text before and text after calls stay apart: the first whitespace next to the calls
    # between them separates them
    DROP_SPACE = True

    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.gap = ""  # whitespace before the open call (dropped if the call parses)
        self.after_call = False  # whitespace that follows a call is dropped
        self.scan = 0  # where the open call's close marker is looked for
        self.wrote = False  # whether any content came before
        self.separator, self.locked = "", False  # what goes between that content and text after the calls

    def _out(self, content: list[str], text: str) -> None:
        if text:
            if self.separator:
                content.append(self.separator)
            content.append(text)
            self.wrote, self.separator, self.locked = True, "", False

    def parse_block(self, body: str) -> ToolCall | list[ToolCall] | None:
        """The call (or, in formats whose blocks hold several, the calls) in ``body`` (the
        text between the markers); None: malformed."""
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)`` that ``text`` (the next piece of the answer) adds."""
        self.buffer += text
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(self.CLOSE, self.scan)
                if end < 0:
                    break
                stop = end + len(self.CLOSE)
                call = _named(self.parse_block(self.buffer[len(self.OPEN):end]))
                if call is None:  # a close marker inside an argument's text? read on to the next one
                    next_close, next_open = self.buffer.find(self.CLOSE, stop), self.buffer.find(self.OPEN, stop)
                    if next_close >= 0 and (next_open < 0 or next_close < next_open):
                        self.scan = stop
                        continue
                    if next_open < 0:  # (which comes first decides)
                        break
                    self._out(content, self.gap + self.buffer[:stop])
                else:
                    calls.extend(call if isinstance(call, list) else [call])
                    if self.DROP_SPACE and self.wrote:  # (the first whitespace run next to the calls: kept)
                        self.separator = self.separator or self.gap
                        self.locked = bool(self.separator)
                self.buffer = self.buffer[stop:]
                self.in_call, self.gap, self.after_call, self.scan = False, "", call is not None and self.DROP_SPACE, 0
                continue
            if self.after_call:
                stripped = self.buffer.lstrip()
                if self.wrote and not self.locked:
                    self.separator += self.buffer[:len(self.buffer) - len(stripped)]
                self.buffer = stripped
                if not self.buffer:
                    break
                self.after_call = False
            start = self.buffer.find(self.OPEN)
            if start < 0:  # hold back a possible marker start and the whitespace before it
                keep = _held(self.buffer, (self.OPEN,))
                text_part = self.buffer[:len(self.buffer) - keep]
                emit = text_part.rstrip() if self.DROP_SPACE else text_part
                self._out(content, emit)
                self.buffer = self.buffer[len(emit):]
                break
            before = self.buffer[:start]
            kept = before.rstrip() if self.DROP_SPACE else before
            self._out(content, kept)
            self.gap = before[len(kept):]
            self.buffer, self.in_call = self.buffer[start:], True
        return "".join(content), calls

    def finish(self) -> str:
        """The content held back, at the end of the answer (an open call is content)."""
        rest, self.buffer, self.scan = self.buffer, "", 0
        text = self.gap + rest if self.in_call else rest.lstrip() if self.after_call else rest
        if text and self.separator:
            text = self.separator + text
        self.separator = ""
        return text


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    def parse_block(self, body: str) -> ToolCall | None:
        obj = _json_object(body.strip())
        # (a name with a lone surrogate, "\\ud83d" in the model's JSON, names no tool and cannot be sent as itself)
        if obj is None or not isinstance(obj.get("name"), str) or _SURROGATE.search(obj["name"]):
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # (some models write the arguments as JSON text)
            arguments = _json_object(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(obj["name"], _dumps(arguments))


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", re.S)
# a value ends at the </parameter> that the next parameter or the function's end follows (a value may hold one)
_CODER_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
_CODER_PARAMETER_BOUNDARY = re.compile(r"</parameter>\s*(?=<parameter=)")


class Qwen3CoderParser(ToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``;
    ``tools``: the request's (OpenAI's shape), whose schemas type the values."""

    def __init__(self, tools: list[dict] | None = None):
        super().__init__()
        self.schemas = {}  # function name -> (its parameters' properties, its parameters)
        for tool in tools or []:
            fn = tool.get("function") or {}
            if isinstance(fn.get("name"), str):
                params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
                props = _object_schema(params)[0].get("properties")  # (a root $ref: its definition's)
                self.schemas[fn["name"]] = (props if isinstance(props, dict) else {}, params)

    def parse_block(self, body: str) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        params = _adjacent_parameters(inner, _CODER_PARAMETER_OPEN, _CODER_PARAMETER_BOUNDARY, lambda m: m.group(1))
        if params is None:  # text outside the parameters: not this format
            return None
        props, root = self.schemas.get(name, ({}, {}))
        args = {}
        for key, value in params:
            value = value.removeprefix("\n").removesuffix("\n")  # (the template's newlines around it)
            args[key.strip()] = self.convert(value, props.get(key.strip()), root)
        return ToolCall(name, _dumps(args))

    @staticmethod
    def convert(value: str, schema, root: dict | None = None) -> object:
        """``value`` as the ``enum`` / ``const`` value of the ``schema`` it writes (see
        :func:`_coder_words`), else as a JSON value of a type the schema allows
        (:func:`schema_types`, ``root``: the tool's ``parameters``; the first that parses),
        else the text."""
        for option in _enum(schema, root) or ():
            if value in _coder_words(option):
                return option
        types = schema_types(schema, root) or []
        want = {"integer": int, "number": (int, float, _BigNumber), "boolean": bool, "null": type(None), "object": dict,
                "array": list}
        for t in types:
            if t not in want:
                continue
            text = value.strip().lower() if t in ("boolean", "null") else value.strip()
            if t == "null" and text == "none":  # (Python's None, as a template's ``| string`` writes it)
                return None
            try:
                parsed = _json(text)
            except ValueError:
                continue
            if isinstance(parsed, want[t]) and not (t in ("integer", "number") and isinstance(parsed, bool)):
                return parsed
        return value


_NAME = r"""\s*(?:"([^"\n]*)"|'([^'\n]*)'|([^>"'\n]+))\s*"""
_INVOKE_OPEN = re.compile(rf"<invoke name={_NAME}>")
_PARAMETER_OPEN = re.compile(rf"<parameter name={_NAME}>")
# between two parameters written one after the other: where a value may end (it may hold a </parameter>)
_PARAMETER_BOUNDARY = re.compile(r"</parameter>\s*(?=<parameter name=)")
INVOKE_CLOSE, PARAMETER_CLOSE = "</invoke>", "</parameter>"
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_BOOLEANS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _group(m: re.Match, first: int) -> str:
    """The name of a ``name=`` attribute: the first of its three alternatives that matched."""
    return next(g for g in m.group(first, first + 1, first + 2) if g is not None).strip()


def _elements(text: str, opener: re.Pattern, close: str) -> list[tuple[str, str]]:
    """``(name, inner text)`` of each ``<TAG name=NAME>inner</TAG>`` of ``text``, the inner
    text ending at the first ``close``; text between elements is skipped, an element without
    its ``close`` ends the list. One pass over the text (no backtracking on long replies)."""
    out, at = [], 0
    while (m := opener.search(text, at)) is not None:
        end = text.find(close, m.end())
        if end < 0:
            break
        out.append((_group(m, 1), text[m.end():end]))
        at = end + len(close)
    return out


def _adjacent_parameters(inner: str, opener: re.Pattern = _PARAMETER_OPEN, boundary: re.Pattern = _PARAMETER_BOUNDARY,
                         key=lambda m: _group(m, 1)) -> list[tuple[str, str]] | None:
    """``(key, value)`` of a call's parameters (``opener`` the opening tag, ``boundary`` a
    ``</parameter>`` before the next one; ``key`` reads an opener's match) when the call holds
    nothing else (whitespace aside), a value ending at the ``</parameter>`` that the next
    parameter or the call's end follows (so a value may hold ``</parameter>``); None when
    there is other text. One pass over the text."""
    text = inner.strip()
    if not text:
        return []
    pieces = boundary.split(text)
    if not pieces[-1].endswith(PARAMETER_CLOSE):
        return None
    pieces[-1] = pieces[-1][:-len(PARAMETER_CLOSE)]
    out = []
    for piece in pieces:
        m = opener.match(piece)
        if m is None:
            return None
        out.append((key(m), piece[m.end():]))
    return out


class MiniMaxM2Parser(Qwen3CoderParser):
    """``<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...
    </invoke>...</minimax:tool_call>``; ``tools`` as :class:`Qwen3CoderParser`'s.

    Read as MiniMax's guide reads them: every ``<invoke>`` of a block is a call (text between
    them is ignored), every ``<parameter>`` of a call an argument, its value without the
    surrounding whitespace, typed by :meth:`convert`. A block without a call stays text."""

    OPEN, CLOSE = MINIMAX_CALL_OPEN, MINIMAX_CALL_CLOSE

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls = []
        for name, inner in _elements(body, _INVOKE_OPEN, INVOKE_CLOSE):
            if not name:
                continue
            props, root = self.schemas.get(name, ({}, {}))
            params = _adjacent_parameters(inner)
            if params is None:  # (other text in the call: each value ends at its first </parameter>)
                params = _elements(inner, _PARAMETER_OPEN, PARAMETER_CLOSE)
            args = {key: self.convert(value.strip(), props.get(key), root) for key, value in params}
            calls.append(ToolCall(name, _dumps(args)))
        return calls or None

    @staticmethod
    def convert(value: str, schema, root: dict | None = None) -> object:
        """``value`` as MiniMax's guide types it: ``null`` (any case) is null whatever the
        schema; the ``enum`` / ``const`` value it writes; else by the types the schema allows
        (:func:`schema_types`), the first that reads: ``string`` the text, ``integer`` a
        decimal integer (``+5`` too), ``number`` a decimal number (an integral one as an
        integer: ``1e3`` is 1000), ``boolean`` true / 1 / yes / on or false / 0 / no / off
        (any case), ``object`` / ``array`` a JSON value of that type; else (no schema) the
        text."""
        if value.lower() == "null":
            return None
        for option in _enum(schema, root) or ():
            if value in _coder_words(option):
                return option
        for t in schema_types(schema, root) or ["string"]:
            if t == "string":
                return value
            if t == "integer" and _INTEGER.fullmatch(value):
                return int(value)
            if t == "number" and _NUMBER.fullmatch(value):
                number = float(value)
                if not math.isfinite(number):
                    return _BigNumber(value)
                return int(number) if number.is_integer() and abs(number) < 2 ** 63 else number
            if t == "boolean" and value.lower() in _BOOLEANS:
                return _BOOLEANS[value.lower()]
            if t in ("object", "array"):
                try:
                    parsed = _json(value)
                except ValueError:
                    continue
                if isinstance(parsed, dict if t == "object" else list):
                    return parsed
        return value


# GLM's calls: ``<tool_call>NAME`` then ``<arg_key>KEY</arg_key>`` ``<arg_value>VALUE</arg_value>`` pairs
# (GLM-4.5 / 4.6: each on its own line; GLM-4.7 / 5: no whitespace), then ``</tool_call>``
GLM_KEY_OPEN, GLM_KEY_CLOSE, GLM_VALUE_OPEN, GLM_VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
GLM_MARKERS = (CALL_OPEN, CALL_CLOSE, GLM_KEY_OPEN, GLM_KEY_CLOSE, GLM_VALUE_OPEN, GLM_VALUE_CLOSE)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>", re.S)
# between two arguments: where a value may end (it may hold an </arg_value>)
_GLM_BOUNDARY = re.compile(r"</arg_value>\s*(?=<arg_key>)")


class Glm45Parser(Qwen3CoderParser):
    """GLM's ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``
    (GLM-4.5 / 4.6 write a newline after the name and after each tag pair, GLM-4.7 / 5
    nothing; any whitespace there is read); ``tools`` as :class:`Qwen3CoderParser`'s.

    The name is the text before the first ``<arg_key>`` (without its surrounding whitespace;
    none, or one holding a newline or ``<``: not a call); the call holds nothing but its
    arguments (whitespace aside), a value ending at the ``</arg_value>`` that the next
    ``<arg_key>`` or the call's end follows; a key loses its surrounding whitespace, a value
    is kept as written and typed by :meth:`convert`."""

    def parse_block(self, body: str) -> ToolCall | None:
        at = body.find(GLM_KEY_OPEN)
        name, rest = (body, "") if at < 0 else (body[:at], body[at:])
        name = name.strip()
        if not name or any(c in name for c in "<\n"):
            return None
        args = {}
        rest = rest.strip()
        if rest:
            pieces = _GLM_BOUNDARY.split(rest)
            if not pieces[-1].endswith(GLM_VALUE_CLOSE):
                return None
            pieces[-1] = pieces[-1][:-len(GLM_VALUE_CLOSE)]
            props, root = self.schemas.get(name, ({}, {}))
            for piece in pieces:
                m = _GLM_ARGUMENT.match(piece)
                if m is None:
                    return None
                key = m.group(1).strip()
                args[key] = self.convert(piece[m.end():], props.get(key), root)
        return ToolCall(name, _dumps(args))

    @staticmethod
    def convert(value: str, schema, root: dict | None = None) -> object:
        """``value`` as GLM's template writes it back (a string as itself, any other value as
        ``tojson``): the ``enum`` / ``const`` value it writes; where the schema says its types,
        as :meth:`Qwen3CoderParser.convert` reads them; where it does not (no schema), the
        JSON value when it parses as one, else the text."""
        if schema_types(schema, root) is not None or _enum(schema, root):
            return Qwen3CoderParser.convert(value, schema, root)
        try:
            return _json(value.strip())
        except ValueError:
            return value


# Kimi-K2's calls: a section of calls, each ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
# {JSON}<|tool_call_end|>``
KIMI_SECTION_OPEN, KIMI_SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_OPEN, KIMI_ARGUMENTS, KIMI_CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_MARKERS = (KIMI_SECTION_OPEN, KIMI_SECTION_CLOSE, KIMI_CALL_OPEN, KIMI_ARGUMENTS, KIMI_CALL_CLOSE)
# the header of a Kimi call: ``functions.NAME:IDX`` (the prefix and the index as the model may leave them out)
_KIMI_HEADER = re.compile(r"(?:functions\.)?([^\s<]+?)(:\d+)?")
# DeepSeek's calls (fullwidth bars, "▁" for spaces): a section of calls, each
# ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>`` (V3.1) or
# ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{JSON}\n```<｜tool▁call▁end｜>`` (V3, R1)
DEEPSEEK_CALLS_OPEN, DEEPSEEK_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_OPEN, DEEPSEEK_SEP, DEEPSEEK_CALL_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_MARKERS = (DEEPSEEK_CALLS_OPEN, DEEPSEEK_CALLS_CLOSE, DEEPSEEK_CALL_OPEN, DEEPSEEK_SEP, DEEPSEEK_CALL_CLOSE)
_DEEPSEEK_V3_CALL = re.compile(r"\s*([^\s`]+)\s*```json\s*(.*?)\s*```\s*", re.S)


def _section_calls(body: str, call_open: str, call_close: str) -> list[str] | None:
    """The insides of the calls (``call_open`` ... ``call_close``) of a section's ``body``
    when it holds one or more and nothing else (whitespace aside), a call ending at the
    ``call_close`` that the next call or the section's end follows (so its arguments may hold
    one); None otherwise."""
    text = body.strip()
    if len(text) < len(call_open) + len(call_close) or not text.startswith(call_open) or not text.endswith(call_close):
        return None
    boundary = re.escape(call_close) + r"\s*" + re.escape(call_open)
    return re.split(boundary, text[len(call_open):-len(call_close)])


class KimiK2Parser(ToolParser):
    """Kimi-K2's ``<|tool_calls_section_begin|>`` section of calls
    ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>``
    (any whitespace between the parts). A call's ``id`` is its header as written
    (``functions.NAME:IDX``, which Kimi's template writes back for the call); the
    ``functions.`` prefix and ``:IDX`` may be missing (then the id is a ``call_`` one). A
    section holding anything but such calls (or none) stays text."""

    OPEN, CLOSE = KIMI_SECTION_OPEN, KIMI_SECTION_CLOSE

    def parse_block(self, body: str) -> list[ToolCall] | None:
        insides = _section_calls(body, KIMI_CALL_OPEN, KIMI_CALL_CLOSE)
        if insides is None:
            return None
        calls = []
        for inside in insides:
            header, sep, arguments = inside.partition(KIMI_ARGUMENTS)
            m, obj = _KIMI_HEADER.fullmatch(header.strip()), _json_object(arguments.strip())
            if not sep or m is None or obj is None:
                return None
            calls.append(ToolCall(m[1], _dumps(obj)))
            if m[2]:
                calls[-1].id = header.strip()
        return calls


class DeepSeekV31Parser(ToolParser):
    """DeepSeek's ``<｜tool▁calls▁begin｜>`` section of calls, each as V3.1 writes it
    (``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``) or as V3 / R1 do
    (``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>``),
    any whitespace between the parts. A section holding anything but such calls (or none)
    stays text."""

    OPEN, CLOSE = DEEPSEEK_CALLS_OPEN, DEEPSEEK_CALLS_CLOSE

    def parse_block(self, body: str) -> list[ToolCall] | None:
        insides = _section_calls(body, DEEPSEEK_CALL_OPEN, DEEPSEEK_CALL_CLOSE)
        if insides is None:
            return None
        calls = []
        for inside in insides:
            name, sep, arguments = inside.partition(DEEPSEEK_SEP)
            m = _DEEPSEEK_V3_CALL.fullmatch(arguments) if name.strip() == "function" else None
            name, arguments = (m[1], m[2]) if m else (name.strip(), arguments)
            obj = _json_object(arguments.strip())
            if not sep or not name or any(c.isspace() or c == "<" for c in name) or obj is None:
                return None
            calls.append(ToolCall(name, _dumps(obj)))
        return calls


class HarmonyToolParser(HarmonyParser):
    """gpt-oss's harmony messages: reasoning, answer and calls (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.role = ""  # the text after <|start|>: the role and maybe the recipient
        self.call = None  # the function of the open call message
        self.args = []
        self.calls: list[ToolCall] = []

    def _text(self, text: str, parts: dict) -> None:
        if self.state == "between":
            self.role += text
        elif self.state == "body" and self.call is not None:
            self.args.append(text)
        else:
            super()._text(text, parts)

    def _marker(self, marker: str, parts: dict) -> None:
        if marker == "<|start|>":
            self.role = ""
        elif marker == "<|message|>":
            recipients = [w[3:] for w in (self.role + " " + self.header).split() if w.startswith("to=")]
            if recipients and recipients[0].startswith("functions."):
                self.call = recipients[0][len("functions."):]
        elif marker in ("<|call|>", "<|end|>", "<|return|>"):
            self._close(parts)
            self.role = ""
        super()._marker(marker, parts)

    def _close(self, parts: dict) -> None:
        if self.call is None:
            return
        body = "".join(self.args)
        obj = _json_object(body)
        if obj is None or tool_name_error(self.call) is not None:  # (no arguments object, or no name: text)
            parts["answer"].append(body)
        else:
            self.calls.append(ToolCall(self.call, _dumps(obj)))
        self.call, self.args = None, []

    def take(self, text: str) -> tuple[str, str, list[ToolCall]]:
        reasoning, answer = self.feed(text)
        calls, self.calls = self.calls, []
        return reasoning, answer, calls

    def finish_reply(self, complete: bool) -> tuple[str, str, list[ToolCall]]:
        if self.call is None:
            reasoning, answer = self.finish()
            return reasoning, answer, []
        self.args.append(self.buffer)
        self.buffer = ""
        if complete:
            parts = {"reasoning": [], "answer": []}
            self._close(parts)
            calls, self.calls = self.calls, []
            return "", "".join(parts["answer"]), calls
        body, self.args, self.call = "".join(self.args), [], None
        return "", body, []


_GEMMA4_CALL = re.compile(r"\s*call:([^{\s]+)\{(.*)\}\s*", re.S)


class Gemma4Parser(ToolParser):
    """``<|tool_call>call:NAME{ARGUMENTS}<tool_call|>`` (see the module docstring)."""

    OPEN, CLOSE = GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE
    DROP_SPACE = False  # (calls sit inside the text: " then <call> end" keeps its spaces)

    def parse_block(self, body: str) -> ToolCall | None:
        m = _GEMMA4_CALL.fullmatch(body)
        if m is None:
            return None
        try:
            arguments, end = _gemma4_members(m[2], 0, "", 0)
        except ValueError:
            return None
        return ToolCall(m[1], _dumps(arguments)) if end == len(m[2]) else None




def _gemma4_members(text: str, at: int, closer: str, depth: int) -> tuple[dict, int]:
    """The ``key:value`` pairs of Gemma's notation from ``text[at:]`` up to ``closer`` (the
    ``}`` of a nested object; "": the end of the text), ``depth`` brackets in:
    ``(object, index after them)``.

    Raises:
        ValueError: anything else (a key without a value, an unclosed string or bracket,
            nesting deeper than :data:`MAX_DEPTH`).
    """
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    out = {}
    while True:
        at = _skip_space(text, at)
        if at == len(text) or text.startswith(closer or "\0", at):
            return out, at
        if text.startswith(GEMMA4_QUOTE, at):
            key, at = _gemma4_string(text, at)
        else:
            colon = text.find(":", at)
            if colon < 0:
                raise ValueError("a key without a value")
            key, at = text[at:colon].strip(), colon
        at = _skip_space(text, at)
        if not key or not text.startswith(":", at):
            raise ValueError("a key without a value")
        out[key], at = _gemma4_value(text, at + 1, "}", depth)
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at += 1
        elif not (at == len(text) or text.startswith(closer or "\0", at)):
            raise ValueError("pairs not split by commas")


def _gemma4_value(text: str, at: int, closers: str, depth: int) -> tuple[object, int]:
    """One value of Gemma's notation at ``text[at:]`` (a bare one ends before a comma or one of
    ``closers``; bare numbers, ``true``, ``false`` are strict JSON's, ``null`` / ``None`` null,
    anything else a string): ``(value, index after it)``."""
    at = _skip_space(text, at)
    if text.startswith(GEMMA4_QUOTE, at):
        return _gemma4_string(text, at)
    if depth >= MAX_DEPTH and text.startswith(("{", "["), at):
        raise ValueError("nested too deeply")
    if text.startswith("{", at):
        value, at = _gemma4_members(text, at + 1, "}", depth + 1)
        if not text.startswith("}", at):
            raise ValueError("an unclosed object")
        return value, at + 1
    if text.startswith("[", at):
        items, at = [], _skip_space(text, at + 1)
        while not text.startswith("]", at):
            item, at = _gemma4_value(text, at, "]", depth + 1)
            items.append(item)
            at = _skip_space(text, at)
            if text.startswith(",", at):
                at = _skip_space(text, at + 1)
            elif not text.startswith("]", at):
                raise ValueError("an unclosed list")
        return items, at + 1
    end = at
    while end < len(text) and text[end] != "," and text[end] not in closers:
        end += 1
    bare = text[at:end].strip()
    if not bare:
        raise ValueError("a missing value")
    if bare in ("null", "None"):
        return None, end
    try:
        value = _json(bare)
    except ValueError:
        return bare, end
    return (value if isinstance(value, (bool, int, float)) else bare), end


def _gemma4_string(text: str, at: int) -> tuple[str, int]:
    """The string between the ``<|"|>`` markers at ``text[at:]``: ``(string, index after it)``."""
    end = text.find(GEMMA4_QUOTE, at + len(GEMMA4_QUOTE))
    if end < 0:
        raise ValueError("an unclosed string")
    return text[at + len(GEMMA4_QUOTE):end], end + len(GEMMA4_QUOTE)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class ReplyParser:
    """A chat reply's reasoning, content and tool calls, piece by piece: the reasoning
    parser (:mod:`.reasoning`, or none) splits off the reasoning, the tool parser (or none)
    finds the calls in the answer; or one :class:`HarmonyToolParser` for both. ``one_call``
    (a request's ``parallel_tool_calls`` false): the reply's first call only, as vLLM returns
    it (OpenAI: at most one call); the calls after it are dropped, the text around them kept."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | HarmonyToolParser | None,
                 one_call: bool = False):
        self.reasoning, self.tools, self.one_call = reasoning, tools, one_call
        self.calls = 0  # (the calls returned so far)

    def _kept(self, parts: tuple[str, str, list[ToolCall]]) -> tuple[str, str, list[ToolCall]]:
        reasoning, content, calls = parts
        if self.one_call:
            calls = calls[:max(0, 1 - self.calls)]
        self.calls += len(calls)
        return reasoning, content, calls

    def feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """``(reasoning, content, calls)`` that ``text`` (the next piece of the reply) adds."""
        return self._kept(self._feed(text))

    def finish(self, complete: bool) -> tuple[str, str, list[ToolCall]]:
        """What is held back, at the end of the reply; ``complete``: it ended with a stop
        token or string (not cut by ``max_tokens``)."""
        return self._kept(self._finish(complete))

    def _feed(self, text: str) -> tuple[str, str, list[ToolCall]]:
        if isinstance(self.tools, HarmonyToolParser):
            return self.tools.take(text)
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if self.tools is None:
            return reasoning, answer, []
        content, calls = self.tools.feed(answer)
        return reasoning, content, calls

    def _finish(self, complete: bool) -> tuple[str, str, list[ToolCall]]:
        if isinstance(self.tools, HarmonyToolParser):
            return self.tools.finish_reply(complete)
        reasoning, answer = ("", "") if self.reasoning is None else self.reasoning.finish()
        if self.tools is None:
            return reasoning, answer, []
        content, calls = self.tools.feed(answer)
        return reasoning, content + self.tools.finish(), calls

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its reasoning (:attr:`ReasoningParser.thinking`)."""
        reasoning = self.tools if isinstance(self.tools, HarmonyToolParser) else self.reasoning
        return reasoning is not None and reasoning.thinking

    @property
    def answering(self) -> bool:
        """Whether the reply is known to be in its answer (:attr:`ReasoningParser.answering`;
        always, without a reasoning parser)."""
        reasoning = self.tools if isinstance(self.tools, HarmonyToolParser) else self.reasoning
        return reasoning is None or reasoning.answering


# The arguments of constrained hermes calls: JSON as the templates render a call (``tojson``:
# ", " and ": ", no other whitespace); a tool's own "x-guidance" options override these.
HERMES_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# at most 4 whitespace characters between a reasoning's </think> and the first call
_AFTER_REASONING = '/[ \\t\\r\\n]{0,4}/'


def _arguments_schema(function: dict) -> dict | bool:
    """A tool's ``parameters`` as the schema of its call's ``arguments``: an object (``type``
    ``object``, where the schema names no type or a list of types with ``object`` among them:
    ``["object", "null"]`` allows other values, which are no call's arguments); no
    ``parameters``: the empty object (OpenAI: "omitting parameters defines a function with an
    empty parameter list"). (A type that allows no object is refused with the request:
    :func:`~dflash_torch.options.check_tools`.)"""
    params = function.get("parameters")
    if not isinstance(params, dict):
        return {"type": "object", "properties": {}, "additionalProperties": False, "x-guidance": HERMES_JSON_OPTIONS}
    schema = dict(params)
    if schema.get("type") is None or isinstance(schema["type"], list):  # (a list without object: refused before)
        schema["type"] = "object"
    guidance = schema.get("x-guidance")
    schema["x-guidance"] = {**HERMES_JSON_OPTIONS, **(guidance if isinstance(guidance, dict) else {})}
    return schema


def _called_functions(tools: list[dict], name: str | None) -> list[dict]:
    """The functions of ``tools`` (OpenAI's shape) a forced reply may call: ``name`` only, or all;
    a function with ``"strict": true`` with its ``parameters`` as OpenAI's strict mode reads
    them: each object takes the keys its schema declares, no others, where that can hold
    (:func:`.constraints.strict_schema`, the root an object's schema; a root union's branches
    closed, the root itself not).

    Raises:
        DFlashError: none; a strict function's ``parameters`` nested too deeply to read."""
    functions = [t.get("function") or {} for t in tools]
    functions = [f for f in functions if isinstance(f.get("name"), str) and (name is None or f["name"] == name)]
    if not functions:
        raise DFlashError(f"tools has no function {name!r} to call" if name is not None else "tools has no function")
    return [{**f, "parameters": strict_schema(f["parameters"], is_object=True)}
            if f.get("strict") is True and isinstance(f.get("parameters"), dict) else f for f in functions]


def _calls_grammar(alternatives: list[str], rules: list[str], one: bool, reasoning: str | None,
                   think_tokens: tuple[int | None, int | None], separator: str = "\n", lead: str = "",
                   section: tuple[str, str] = ("", "")) -> str:
    """The grammar of a reply that is only calls: ``alternatives`` (one Lark expression per
    callable function) and their ``rules``; ``one``: exactly one call, else one or more
    separated by ``separator`` (a newline unless told); ``reasoning``: first the rest of the
    reasoning the template opened, or a reasoning the reply may open
    (:func:`.constraints.reasoning_start`); ``lead``: a Lark expression before all that;
    ``section``: Lark expressions before and after the calls (Kimi's, DeepSeek's section)."""
    calls = "call" if one else f"call ({json.dumps(separator)} call)*" if separator else "call+"
    head, reasoning_rules = reasoning_start(reasoning, think_tokens, _AFTER_REASONING)
    calls = " ".join(e for e in (section[0], calls, section[1]) if e)
    return f"start: {lead}{head}{calls}\n" + "call: " + " | ".join(alternatives) + "\n" + "".join(rules) + reasoning_rules


def hermes_grammar(tools: list[dict], name: str | None = None, parallel: bool = True,
                   reasoning: str | None = None, think_tokens: tuple[int | None, int | None] = (None, None),
                   call_tokens: tuple[int | None, int | None] = (None, None)) -> str:
    """An llguidance Lark grammar (:class:`~dflash_torch.structured.StructuredOutput`
    ``grammar``) of a reply that is only hermes tool calls, as :class:`HermesParser` reads
    them: ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` where NAME is
    one of ``tools`` (OpenAI's shape) and ARGS a JSON object valid under that tool's
    ``parameters`` schema (:data:`HERMES_JSON_OPTIONS`). ``name``: that function only, one
    call (``tool_choice`` a named function); else one call or more (``tool_choice``
    ``required``), separated by a newline, or exactly one when ``parallel`` is False. The
    reply ends (EOS) after the last call. ``reasoning``: ``"opened"``, the template opened a
    ``<think>`` in the prompt: the reply first closes it (any text up to ``</think>``, then
    up to 4 whitespace characters); ``"optional"``: the reply may first open a reasoning
    and close it (a model that writes its own ``<think>``, as Qwen3's thinking mode); None:
    no reasoning (:func:`.constraints.reasoning_start`; ``think_tokens``: the tokenizer's
    one token for ``<think>`` and ``</think>``, :func:`.constraints.think_tokens`, None
    where it is text). ``call_tokens``: the tokenizer's one token
    for ``<tool_call>`` and for ``</tool_call>`` where it has them (Qwen3's added tokens,
    :func:`.constraints.special_token`), which llguidance never matches to the text, so the
    grammar also takes the token (else the model would have to spell the marker out).

    Raises:
        DFlashError: ``tools`` has no function (named ``name``)."""
    rules, alternatives = [], []
    call_open, call_close = (text_or_token(text, token) for text, token in zip((CALL_OPEN, CALL_CLOSE), call_tokens))
    for i, fn in enumerate(_called_functions(tools, name)):
        head = json.dumps(f'\n{{"name": {_dumps(fn["name"])}, "arguments": ')
        alternatives.append(f"{call_open} {head} arguments_{i} {json.dumps('}' + chr(10))} {call_close}")
        rules.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(fn))}\n")
    return _calls_grammar(alternatives, rules, name is not None or not parallel, reasoning, think_tokens)


# a qwen3_coder text value: any text up to the first newline + </parameter> + newline (the
# template writes the value, then "\n</parameter>\n"), that closing included
_CODER_TEXT = "/(?s:.*)\\n<\\/parameter>\\n/"
_CODER_VALUE_END = json.dumps("\n</parameter>\n")


def _json_value_schema(schema: dict, root: dict) -> dict:
    """A parameter's ``schema`` as the ``%json`` of a forced call's typed value: with the JSON
    options of hermes' calls, then the tool's own (its ``parameters``' ``x-guidance``), then
    the property's, and the tool's ``$defs`` / ``definitions`` (which a ``$ref`` inside names)."""
    own = [g for g in (root.get("x-guidance"), schema.get("x-guidance")) if isinstance(g, dict)]
    typed = {**schema, "x-guidance": {k: v for g in [HERMES_JSON_OPTIONS, *own] for k, v in g.items()}}
    for key in ("$defs", "definitions"):
        if isinstance(root.get(key), dict) and key not in typed:
            typed[key] = root[key]
    return typed


def _coder_value(schema, rule: str, rules: list[str], root: dict) -> str:
    """The Lark expression of one ``qwen3_coder`` parameter's value and its closing
    ``\\n</parameter>\\n``, as :meth:`Qwen3CoderParser.convert` reads it back valid under
    ``schema`` (``root``: the tool's ``parameters``, whose ``$defs`` / ``definitions`` a
    ``$ref`` names): a choice (``enum`` / ``const``) as its values written as the template
    writes them (:func:`_coder_words`); a schema whose types (:func:`schema_types`: its
    ``type``, or those of its ``anyOf`` / ``oneOf`` branches, its ``allOf``, its ``$ref``)
    are JSON ones other than ``string``, as that JSON valid under it (``%json``, written as
    templates' ``tojson``), or ``None`` / ``True`` / ``False`` where it allows null / a
    boolean (the template's ``| string``); any other (``string`` among its types, or types
    it does not say) as text (a string's keywords, e.g. ``pattern``, are not enforced)."""
    schema = schema if isinstance(schema, dict) else {}
    options = _enum(schema, root)
    if options:
        words = list(dict.fromkeys(w for o in options for w in _coder_words(o)))
        return "(" + " | ".join(json.dumps(w, ensure_ascii=False) for w in words) + f") {_CODER_VALUE_END}"
    types = schema_types(schema, root)
    if types is None or "string" in types:
        rules.append(f"{rule}[lazy]: {_CODER_TEXT}\n")
        return rule
    words = (["None"] if "null" in types else []) + (["True", "False"] if "boolean" in types else [])
    rules.append(f"{rule}: %json {json.dumps(_json_value_schema(schema, root))}"
                 + "".join(f" | {json.dumps(w)}" for w in words) + "\n")
    return f"{rule} {_CODER_VALUE_END}"


def schema_types(schema, root: dict | None = None, depth: int = 0) -> list[str] | None:
    """The JSON types a (sub)schema allows, as far as it says: its ``type``; else the union of
    its ``anyOf`` / ``oneOf`` branches', the intersection of its ``allOf`` branches', or
    those of the definition its ``$ref`` names (``#/$defs/NAME`` or ``#/definitions/NAME`` in
    ``root``); None where it does not say (any type)."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind] if kind in JSON_TYPES else None
    if isinstance(kind, list) and kind and all(k in JSON_TYPES for k in kind):
        return list(kind)
    if isinstance(schema.get("$ref"), str):
        return schema_types(_resolve(schema, root), root, depth + 1)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            found = [schema_types(b, root, depth + 1) for b in branches]
            if any(t is None for t in found):
                return None
            return list(dict.fromkeys(t for ts in found for t in ts))
    branches = schema.get("allOf")
    if isinstance(branches, list) and branches:
        known = [t for t in (schema_types(b, root, depth + 1) for b in branches) if t is not None]
        if known:
            return [t for t in known[0] if all(t in ts for ts in known[1:])]
    return None


def _resolve(schema, root: dict | None):
    """``schema``, or the definition its ``$ref`` names in ``root`` (``#/$defs/NAME``,
    ``#/definitions/NAME``); None for a ``$ref`` it cannot resolve."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or root is None:
        return schema
    for prefix, key in (("#/$defs/", "$defs"), ("#/definitions/", "definitions")):
        defs = root.get(key)
        if ref.startswith(prefix) and isinstance(defs, dict):
            return defs.get(ref[len(prefix):])
    return None


def _enum(schema, root: dict | None = None, depth: int = 0) -> list | None:
    """The values a schema allows when it is a choice: its ``enum`` (or ``const``), through a
    ``$ref`` (a pydantic ``Enum``), or the union of ``anyOf`` / ``oneOf`` branches that are
    each a choice or ``null`` (pydantic's ``Optional[Literal[...]]``); None otherwise."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 16:
        return None
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options:
        return options
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            found = []
            for branch in branches:
                if isinstance(branch, dict) and branch.get("type") == "null" and len(branch) == 1:
                    found.append(None)
                    continue
                values = _enum(branch, root, depth + 1)
                if values is None:
                    return None
                found += values
            return found if any(v is not None for v in found) else None
    return None


def _coder_words(value) -> list[str]:
    """The ways a ``qwen3_coder`` call writes a parameter's ``value``: a string as itself,
    ``True`` / ``None`` as the template's ``| string`` writes them or as JSON, a number as
    its text, an object or array as ``tojson``."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool) or value is None:
        return [str(value), json.dumps(value)]
    return [json.dumps(value, ensure_ascii=False)]


def _check_coder_name(name: str, what: str) -> None:
    """Raises DFlashError for a name the ``qwen3_coder`` format cannot write (``<function=NAME>``
    and ``<parameter=KEY>`` end at the first ``>`` or newline)."""
    if not name or any(c in name for c in ">\n"):
        raise DFlashError(f"tools {what} {name[:80]!r} cannot be written as a qwen3_coder call "
                          "(it is empty or holds '>' or a newline)")


# the keywords of a schema that constrain an object (those of other types' do not apply to the arguments)
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                    "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                    "unevaluatedProperties", "not", "if", "anyOf", "oneOf", "allOf", "enum", "const",
                    "$ref", "$dynamicRef", "$recursiveRef")
# those that a call written as its properties in order (qwen3_coder's, GLM's) cannot be held to
_UNENFORCED = ("not", "if", "anyOf", "oneOf", "allOf", "enum", "const", "propertyNames", "dependentRequired",
               "dependentSchemas", "dependencies", "$ref", "$dynamicRef", "$recursiveRef")


def _object_schema(params: dict, fmt: str | None = None) -> tuple[dict, str]:
    """The schema of the object a tool's ``parameters`` describe, and where it is (for
    messages): ``params`` itself, or the definition its root ``$ref`` names (``#/$defs/NAME``,
    ``#/definitions/NAME`` of ``params``, as zod-to-json-schema writes a tool's schema), or
    the one branch of a root ``allOf`` (a ``$ref`` as pydantic may write it), in turn, where
    that reference or branch is the schema's only constraint on an object.

    ``fmt`` (a format's name, for the grammar of its forced calls, which writes the object's
    ``properties`` and checks their values only): the object must be one such a call can be
    held to. None: as far as it resolves (a parser's reading).

    Raises:
        DFlashError: (``fmt`` given) a reference that does not resolve, a ``type`` that allows
            no object, or a keyword of :data:`_UNENFORCED` beside or instead of that (``not``,
            ``anyOf``, ``propertyNames``, ``dependentRequired``, ...), named with where it is."""
    schema, where = params, "parameters"
    for _ in range(16):
        kind = schema.get("type")
        if fmt and kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise DFlashError(f"{where} must be the JSON Schema of an object (type \"object\"), got type {kind!r}")
        others = [k for k in _OBJECT_KEYWORDS if k in schema and k not in ("$ref", "allOf")]
        if isinstance(schema.get("$ref"), str) and "allOf" not in schema and not others:
            target = _resolve(schema, params)
            if not isinstance(target, dict):
                if fmt:
                    raise DFlashError(f"{where}: its $ref {schema['$ref'][:80]!r} names no definition of the "
                                      f"parameters' $defs or definitions")
                break
            schema, where = target, f"parameters' {schema['$ref'][:80]!r}"
        elif isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1 and \
                isinstance(schema["allOf"][0], dict) and "$ref" not in schema and not others:
            schema, where = schema["allOf"][0], f"{where}.allOf[0]"
        else:
            break
    key = next((k for k in _UNENFORCED if k in schema), None) if fmt else None
    if key is not None:
        raise DFlashError(f"the keyword {key!r} of {where} cannot be enforced in a {fmt} call (a forced call writes "
                          f"the properties, checking their values only, so it could break it); drop it, or use "
                          f"tool_choice 'auto'")
    return schema, where


def _call_parameters(fn: dict, fmt: str) -> tuple[dict, list[tuple[str, dict, bool]]]:
    """A function's ``parameters`` schema (``{}`` where it has none) and the keys the calls
    of the format ``fmt`` write, in order: ``(key, schema, required)`` for the ``properties``
    of the object it describes (:func:`_object_schema`), then for the ``required`` keys they
    do not describe (schema ``{}``: any text). A property whose schema (or the definition its
    ``$ref`` names) is ``"enum": []`` allows no value: an optional one is left out (no call
    writes it, as hermes' JSON schema leaves it out).

    Raises:
        DFlashError: an object such calls cannot be held to (:func:`_object_schema`; or a
            ``minProperties`` above the required keys' count, a ``maxProperties`` below the
            keys' count, a ``patternProperties`` pattern that a property's name matches); a
            required property that allows no value (no call can be written)."""
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    try:
        obj, where = _object_schema(params, fmt)
    except DFlashError as exc:
        raise DFlashError(f"tools function {fn['name']!r}: {exc}") from None
    props = obj.get("properties") if isinstance(obj.get("properties"), dict) else {}
    required = obj.get("required") if isinstance(obj.get("required"), list) else []
    extra = {key: {} for key in required if isinstance(key, str) and key not in props}
    keys = []
    for key, schema in {**props, **extra}.items():
        resolved = _resolve(schema, params)
        if isinstance(resolved, dict) and resolved.get("enum") == []:
            if key in required:
                raise DFlashError(f"tools function {fn['name']!r}: its required parameter {key!r} allows no value "
                                  "(an empty enum), so no call can be written")
            continue
        keys.append((key, schema, key in required))

    def refuse(what: str):
        raise DFlashError(f"tools function {fn['name']!r}: {what} of {where} cannot be enforced in a {fmt} call "
                          f"(a forced call writes the required properties, the others optionally); drop it, or use "
                          f"tool_choice 'auto'")

    least, most = obj.get("minProperties"), obj.get("maxProperties")
    if least is not None and not (isinstance(least, int) and least <= sum(r for _, _, r in keys)):
        refuse(f"minProperties {least!r}")
    if most is not None and not (isinstance(most, int) and most >= len(keys)):
        refuse(f"maxProperties {most!r}")
    patterns = obj.get("patternProperties")
    if patterns is not None and not isinstance(patterns, dict):
        refuse("patternProperties")
    for pattern in patterns or ():  # (one that no property's name matches holds no key the call writes)
        try:
            matched = any(re.search(pattern, key) for key, _, _ in keys)
        except re.error:  # (not Python's regex: whether it matches is not known)
            matched = True
        if matched:
            refuse(f"patternProperties {pattern[:80]!r}")
    return params, keys


def qwen3_coder_grammar(tools: list[dict], name: str | None = None, parallel: bool = True,
                        reasoning: str | None = None, think_tokens: tuple[int | None, int | None] = (None, None),
                        call_tokens: tuple[int | None, int | None] = (None, None)) -> str:
    """As :func:`hermes_grammar`, for the ``qwen3_coder`` format (Qwen3-Coder, Qwen3.5,
    Qwen3.6), as their chat templates write a call and :class:`Qwen3CoderParser` reads it:
    ``<tool_call>\\n<function=NAME>\\n`` then each parameter of the tool's ``parameters``
    ``properties``, in that order, as ``<parameter=KEY>\\nVALUE\\n</parameter>\\n`` (those in
    ``required`` always, the others optionally; then the ``required`` keys that ``properties``
    does not describe, as text; no other keys), then
    ``</function>\\n</tool_call>``; VALUE as :func:`_coder_value` constrains it.

    Raises:
        DFlashError: ``tools`` has no function (named ``name``), or a function or parameter
            name the format cannot write (:func:`_check_coder_name`), or a required parameter that
            allows no value (``"enum": []``), or parameters whose object the calls cannot be held to
            (a keyword such as ``not``, ``anyOf``, ``propertyNames``: :func:`_call_parameters`)."""
    rules, alternatives = [], []
    call_open, call_close = (text_or_token(text, token) for text, token in zip((CALL_OPEN, CALL_CLOSE), call_tokens))
    for i, fn in enumerate(_called_functions(tools, name)):
        _check_coder_name(fn["name"], "function name")
        params, keys = _call_parameters(fn, "qwen3_coder")
        parts = []
        for j, (key, schema, required) in enumerate(keys):
            _check_coder_name(key, f"parameter name of {fn['name']!r}")
            value = _coder_value(schema, f"value_{i}_{j}", rules, params)
            rules.append(f"parameter_{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}\n")
            parts.append(f"parameter_{i}_{j}" + ("" if required else "?"))
        head = json.dumps(f"\n<function={fn['name']}>\n")
        alternatives.append(" ".join([call_open, head, *parts, json.dumps("</function>\n"), call_close]))
    return _calls_grammar(alternatives, rules, name is not None or not parallel, reasoning, think_tokens)


# a GLM text value: any text up to the first </arg_value>, that closing included
_GLM_TEXT = "/(?s:.*)<\\/arg_value>/"


def _glm_value(schema, rule: str, rules: list[str], root: dict, close_token: int | None = None) -> str:
    """The Lark expression of one GLM argument's value and its closing ``</arg_value>``, as
    :meth:`Glm45Parser.convert` reads it back valid under ``schema`` (``root``: the tool's
    ``parameters``): a choice (``enum`` / ``const``) as its values written as the template
    writes them (a string as itself, any other value as ``tojson``); a schema whose types
    (:func:`schema_types`) are JSON ones other than ``string``, as that JSON valid under it
    (``%json``, written as ``tojson``); any other as text. ``close_token``: the tokenizer's
    one token for ``</arg_value>``, also taken (:func:`.constraints.special_token`)."""
    schema = schema if isinstance(schema, dict) else {}
    options = _enum(schema, root)
    end = text_or_token(GLM_VALUE_CLOSE, close_token)
    if options:
        words = list(dict.fromkeys(o if isinstance(o, str) else json.dumps(o, ensure_ascii=False) for o in options))
        return "(" + " | ".join(json.dumps(w, ensure_ascii=False) for w in words) + f") {end}"
    types = schema_types(schema, root)
    if types is None or "string" in types:  # (any text up to the first </arg_value>, that included)
        if close_token is None:
            rules.append(f"{rule}[lazy]: {_GLM_TEXT}\n")
        else:
            rules.append(f"{rule}: {rule}_end | {rule}_text <[{int(close_token)}]>\n{rule}_end[lazy]: {_GLM_TEXT}\n"
                         f"{rule}_text: /(?s:.*)/\n")
        return rule
    rules.append(f"{rule}: %json {json.dumps(_json_value_schema(schema, root))}\n")
    return f"{rule} {end}"


def _check_glm_name(name: str, what: str) -> None:
    """Raises DFlashError for a name a GLM call cannot write (a name or key that is empty,
    has surrounding whitespace, or holds ``<`` or a newline, would not read back as itself)."""
    if not name or name != name.strip() or any(c in name for c in "<\n"):
        raise DFlashError(f"tools {what} {name[:80]!r} cannot be written as a GLM call "
                          "(it is empty, has surrounding whitespace, or holds '<' or a newline)")


def _glm_grammar(tools: list[dict], name: str | None, parallel: bool, reasoning: str | None,
                 think_tokens: tuple[int | None, int | None], call_tokens: tuple[int | None, ...],
                 compact: bool) -> str:
    """:func:`glm45_grammar` (``compact`` False: a newline after the name and after each
    tag pair, calls separated by a newline) or :func:`glm47_grammar` (``compact``: none)."""
    rules, alternatives = [], []
    line = "" if compact else "\n"
    tokens = dict(zip(GLM_MARKERS, [*call_tokens, *[None] * len(GLM_MARKERS)]))
    call_open, call_close, key_open, key_close, value_open = (text_or_token(m, tokens[m]) for m in GLM_MARKERS[:5])
    newline = f" {json.dumps(line)}" if line else ""
    for i, fn in enumerate(_called_functions(tools, name)):
        _check_glm_name(fn["name"], "function name")
        params, keys = _call_parameters(fn, "glm47" if compact else "glm45")
        parts = []
        for j, (key, schema, required) in enumerate(keys):
            _check_glm_name(key, f"parameter name of {fn['name']!r}")
            value = _glm_value(schema, f"value_{i}_{j}", rules, params, tokens[GLM_VALUE_CLOSE])
            head = f"{key_open} {json.dumps(key, ensure_ascii=False)} {key_close}{newline} {value_open}"
            rules.append(f"parameter_{i}_{j}: {head} {value}{newline}\n")
            parts.append(f"parameter_{i}_{j}" + ("" if required else "?"))
        head = json.dumps(fn["name"] + line, ensure_ascii=False)
        alternatives.append(" ".join([call_open, head, *parts, call_close]))
    # (GLM-4.5 / 4.6 begin a reply with a newline: the template writes one before a reasoning or a call)
    return _calls_grammar(alternatives, rules, name is not None or not parallel, reasoning, think_tokens, line,
                          "" if compact else '"\\n"? ')


def glm45_grammar(tools: list[dict], name: str | None = None, parallel: bool = True,
                  reasoning: str | None = None, think_tokens: tuple[int | None, int | None] = (None, None),
                  call_tokens: tuple[int | None, ...] = (None, None)) -> str:
    """As :func:`hermes_grammar`, for GLM-4.5 / 4.6's calls as their chat template writes
    them and :class:`Glm45Parser` reads them: ``<tool_call>NAME\n`` then each parameter of
    the tool's ``parameters`` ``properties``, in that order, as
    ``<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n`` (those in ``required``
    always, the others optionally; then the ``required`` keys that ``properties`` does not
    describe, as text; no other keys), then ``</tool_call>``; calls separated by a newline;
    VALUE as :func:`_glm_value` constrains it; the reply may begin with a newline (as GLM-4.5 /
    4.6 write ``\\n<think>`` and ``\\n<tool_call>``). ``call_tokens``: the tokenizer's one token (or
    None) for each of :data:`GLM_MARKERS` in that order (GLM's tokenizer has them all as
    added tokens), each also taken where given (as :func:`hermes_grammar`'s).

    Raises:
        DFlashError: ``tools`` has no function (named ``name``), or a function or parameter
            name the format cannot write (:func:`_check_glm_name`), or a required parameter that
            allows no value (``"enum": []``), or parameters whose object the calls cannot be held to
            (a keyword such as ``not``, ``anyOf``, ``propertyNames``: :func:`_call_parameters`)."""
    return _glm_grammar(tools, name, parallel, reasoning, think_tokens, call_tokens, compact=False)


def glm47_grammar(tools: list[dict], name: str | None = None, parallel: bool = True,
                  reasoning: str | None = None, think_tokens: tuple[int | None, int | None] = (None, None),
                  call_tokens: tuple[int | None, ...] = (None, None)) -> str:
    """As :func:`glm45_grammar`, for GLM-4.7 / GLM-5's calls, which their chat template
    writes without whitespace: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE
    </arg_value>...</tool_call>``, calls one right after the other."""
    return _glm_grammar(tools, name, parallel, reasoning, think_tokens, call_tokens, compact=True)


def _check_section_name(name: str, what: str) -> None:
    """Raises DFlashError for a function name a Kimi or DeepSeek call cannot write (the parsers
    read a name without whitespace or ``<``)."""
    if not name or any(c.isspace() or c == "<" for c in name):
        raise DFlashError(f"tools function name {name[:80]!r} cannot be written as a {what} call "
                          "(it is empty or holds whitespace or '<')")


def kimi_k2_grammar(tools: list[dict], name: str | None = None, parallel: bool = True,
                    reasoning: str | None = None, think_tokens: tuple[int | None, int | None] = (None, None),
                    call_tokens: tuple[int | None, ...] = ()) -> str:
    """As :func:`hermes_grammar`, for Kimi-K2's calls as :class:`KimiK2Parser` reads them:
    ``<|tool_calls_section_begin|>``, then each call as
    ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>``
    (IDX: the model's own number, 1 to 6 digits; ARGS as hermes' arguments), one right after
    the other, then ``<|tool_calls_section_end|>``. ``call_tokens``: the tokenizer's one token
    (or None) for each of :data:`KIMI_MARKERS` in that order, each also taken where given.

    Raises:
        DFlashError: ``tools`` has no function (named ``name``), or a function name the
            format cannot write (empty, or holding whitespace or ``<``)."""
    tokens = dict(zip(KIMI_MARKERS, [*call_tokens, *[None] * len(KIMI_MARKERS)]))
    section_open, section_close, call_open, arguments, call_close = (text_or_token(m, tokens[m]) for m in KIMI_MARKERS)
    rules, alternatives = ["index: /(0|[1-9][0-9]{0,5})/\n"], []
    for i, fn in enumerate(_called_functions(tools, name)):
        _check_section_name(fn["name"], "Kimi")
        head = json.dumps(f"functions.{fn['name']}:", ensure_ascii=False)
        alternatives.append(f"{call_open} {head} index {arguments} arguments_{i} {call_close}")
        rules.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(fn))}\n")
    return _calls_grammar(alternatives, rules, name is not None or not parallel, reasoning, think_tokens, "",
                          section=(section_open, section_close))


def deepseek_v31_grammar(tools: list[dict], name: str | None = None, parallel: bool = True,
                         reasoning: str | None = None, think_tokens: tuple[int | None, int | None] = (None, None),
                         call_tokens: tuple[int | None, ...] = ()) -> str:
    """As :func:`kimi_k2_grammar`, for DeepSeek-V3.1's calls: ``<｜tool▁calls▁begin｜>``, then
    each call as ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``, one right
    after the other, then ``<｜tool▁calls▁end｜>``; ``call_tokens`` for :data:`DEEPSEEK_MARKERS`.

    Raises:
        DFlashError: as :func:`kimi_k2_grammar`'s."""
    tokens = dict(zip(DEEPSEEK_MARKERS, [*call_tokens, *[None] * len(DEEPSEEK_MARKERS)]))
    calls_open, calls_close, call_open, sep, call_close = (text_or_token(m, tokens[m]) for m in DEEPSEEK_MARKERS)
    rules, alternatives = [], []
    for i, fn in enumerate(_called_functions(tools, name)):
        _check_section_name(fn["name"], "DeepSeek")
        alternatives.append(f"{call_open} {json.dumps(fn['name'], ensure_ascii=False)} {sep} arguments_{i} {call_close}")
        rules.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(fn))}\n")
    return _calls_grammar(alternatives, rules, name is not None or not parallel, reasoning, think_tokens, "",
                          section=(calls_open, calls_close))


# the grammar of forced calls (tool_choice required or a named function) of each format that has one
FORCED_CALL_GRAMMARS = {"hermes": hermes_grammar, "qwen3_coder": qwen3_coder_grammar, "glm45": glm45_grammar,
                        "glm47": glm47_grammar, "kimi_k2": kimi_k2_grammar, "deepseek_v31": deepseek_v31_grammar}
# the markers whose one token (where the tokenizer has one) each format's grammar takes as its call_tokens
FORCED_CALL_MARKERS = {"hermes": (CALL_OPEN, CALL_CLOSE), "qwen3_coder": (CALL_OPEN, CALL_CLOSE), "glm45": GLM_MARKERS,
                       "glm47": GLM_MARKERS, "kimi_k2": KIMI_MARKERS, "deepseek_v31": DEEPSEEK_MARKERS}


def forced_call_reason(message: str) -> str:
    """Why a forced call's grammar cannot be used, in a user's words, from the compile error
    ``message`` (:meth:`~dflash_torch.structured.GrammarCompiler.compile`'s): without the
    positions in the grammar the server wrote (``at 5(14):``) and llguidance's wrapping
    ("failed to compile JSON schema: ..."); its parser's item limit ("Too many items ...
    ff_tokens", met writing the call's forced text) as a schema too large or complex to be
    compiled into a grammar."""
    if "Too many items" in message:
        return ("the schema is too large or complex to be compiled into a grammar of the call (the constraint "
                "engine's parser ran past its limit; a required property whose schema holds itself without end, "
                "so that no finite value fits, does this)")
    reason = message.removeprefix("structured_output grammar ").removeprefix("is invalid: ")
    reason = re.sub(r"\bat \d+\(\d+\): ", "", reason)
    return reason.split("failed to compile JSON schema: ", 1)[-1]


def forced_call_error(tools: list[dict], name: str | None, failure, message: str) -> tuple[str, str]:
    """``(message, param)`` of a 400 for forced calls (``tool_choice`` ``required``, or the
    function ``name``) whose grammar cannot be compiled (``message``: the compile error): names
    the first of the called ``tools`` (OpenAI's shape, in the request's order) whose calls alone
    cannot be compiled (``failure(tool)``: that compile's error message, None when it
    compiles), as ``tools.i.function.parameters`` (the request's dotted path, the ``param``
    too: trial-299 g) with its function's name, and says why (:func:`forced_call_reason`);
    where each compiles alone (the tools together are too large), the reason for all of
    them (``param`` ``tools``)."""
    choice = "'required'" if name is None else f"{name[:80]!r} (a named function)"
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        if name is not None and fn.get("name") != name:
            continue
        error = failure(tool)
        if error is not None:
            where = f"tools.{i}.function.parameters"
            return (f"{where} (function {str(fn.get('name'))[:80]!r}) cannot constrain the forced tool call of "
                    f"tool_choice {choice}: {forced_call_reason(error)}; fix the schema, or use tool_choice 'auto' "
                    f"(not constrained)"), where
    return (f"tools cannot constrain the forced tool calls of tool_choice {choice} together (each tool's alone can "
            f"be): {forced_call_reason(message)}"), "tools"


def check_tool_parser(value: str, name: str = "tool_call_parser") -> str:
    """One of :data:`PARSERS`.

    Raises:
        OptionError: any other value.
    """
    return check_choice(value, PARSERS, name)


def resolve_tool_parser(choice: str, model_type: str, chat_template: str | dict | None, reasoning: str) -> str:
    """The format a server with ``--tool-call-parser choice`` uses: ``auto`` is ``harmony``
    for gpt-oss, ``kimi_k2`` for a chat template with ``<|tool_calls_section_begin|>``,
    ``deepseek_v31`` for one with ``<｜tool▁calls▁begin｜>``, ``gemma4`` for one with
    ``<|tool_call>``, ``minimax_m2`` for one
    with ``<minimax:tool_call>``, ``glm47`` for one with ``<tool_call>`` and
    ``</arg_key><arg_value>`` (GLM-4.7 / 5), ``glm45`` for one with ``<tool_call>`` and
    ``<arg_key>`` otherwise (GLM-4.5 / 4.6), ``qwen3_coder`` for one
    with ``<tool_call>`` and ``<function=``, ``hermes`` for one with ``<tool_call>`` only, else
    ``none``. ``chat_template``: the
    tokenizer's (a dict of named templates: the ``tool_use`` one if any, else ``default``);
    ``reasoning``: the server's resolved reasoning parser.

    Raises:
        DFlashError: ``harmony`` with a reasoning parser other than ``harmony`` (one parser
            reads both from gpt-oss's messages).
    """
    if choice == "auto":
        if model_type == "gpt_oss":
            choice = "harmony" if reasoning == "harmony" else "none"
        else:
            if isinstance(chat_template, dict):
                chat_template = chat_template.get("tool_use") or chat_template.get("default")
            chat_template = chat_template or ""
            choice = "kimi_k2" if KIMI_SECTION_OPEN in chat_template else \
                "deepseek_v31" if DEEPSEEK_CALLS_OPEN in chat_template else \
                "gemma4" if GEMMA4_CALL_OPEN in chat_template else \
                "minimax_m2" if MINIMAX_CALL_OPEN in chat_template else "none" if CALL_OPEN not in chat_template else \
                ("glm47" if GLM_KEY_CLOSE + GLM_VALUE_OPEN in chat_template else "glm45") \
                if GLM_KEY_OPEN in chat_template else "qwen3_coder" if "<function=" in chat_template else "hermes"
    if choice == "harmony" and reasoning != "harmony":
        raise DFlashError(f"--tool-call-parser harmony needs --reasoning-parser harmony (or auto with a gpt-oss "
                          f"target), not {reasoning}")
    return choice


def new_reply_parser(reasoning: str, tools_kind: str, prompt_text: str = "",
                     tools: list[dict] | None = None, parallel: bool = True) -> ReplyParser | None:
    """The parser of a chat reply to a prompt ending in ``prompt_text``: ``reasoning`` and
    ``tools_kind`` resolved (``none`` for a request without tools); ``tools``: the
    request's (for the value types of ``qwen3_coder``, ``glm45`` / ``glm47``, ``minimax_m2``); ``parallel`` false (the request's
    ``parallel_tool_calls``): the reply's first call only. None when both are ``none``."""
    if tools_kind == "harmony":
        return ReplyParser(None, HarmonyToolParser(), not parallel)
    tool_parser = {"hermes": HermesParser, "qwen3_coder": lambda: Qwen3CoderParser(tools),
                   "glm45": lambda: Glm45Parser(tools), "glm47": lambda: Glm45Parser(tools),
                   "minimax_m2": lambda: MiniMaxM2Parser(tools), "gemma4": Gemma4Parser, "kimi_k2": KimiK2Parser,
                   "deepseek_v31": DeepSeekV31Parser}.get(tools_kind)
    reasoning_parser = new_parser(reasoning, prompt_text)
    if reasoning_parser is None and tool_parser is None:
        return None
    return ReplyParser(reasoning_parser, tool_parser and tool_parser(), not parallel)


def parse_reply(parser: ReplyParser, text: str, complete: bool) -> tuple[str, str, list[ToolCall]]:
    """``(reasoning, content, calls)`` of a whole reply."""
    r1, c1, k1 = parser.feed(text)
    r2, c2, k2 = parser.finish(complete)
    return r1 + r2, c1 + c2, k1 + k2
