"""Request schemas of the OpenAI-compatible API and the checks for what the engine
cannot honour.

Parsing is strict about types (``"5"`` is not an integer, ``true`` is not a number)
and about ranges; fields the server does not know are ignored (OpenAI's own API refuses
them; ignoring them lets clients that send newer or other servers' fields work, as
vLLM does) and logged, in nested objects too (:func:`unknown_fields`), except chat-only
fields sent to ``/v1/responses``, refused naming the Responses equivalent. Fields it knows
but cannot honour with a non-default value (``best_of`` other than ``n``, ``suffix``, ...)
are refused with a 400 by :func:`unsupported_field`; values that contradict each other by :func:`conflicting_fields`.

Scoring the prompt: completions' ``echo`` (the prompt's text before the completion, and with
``logprobs`` the prompt's tokens' logprobs first; ``max_tokens`` 0 then returns the prompt
alone) and vLLM's ``prompt_logprobs`` (both endpoints) ask the engine for the prompt's
logprobs (:meth:`_Request.engine_prompt_logprobs`).

Structured outputs (constrained decoding, :mod:`dflash_torch.structured`): OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (one
of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and vLLM's older top-level
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; at most one of
them per request (:meth:`_Request.constraint`). vLLM's ``guided_whitespace_pattern`` (or
``structured_outputs.whitespace_pattern``) sets a JSON constraint's whitespace
(:meth:`_Request.whitespace_pattern`); with no JSON constraint it is refused.
``structured_outputs.disable_any_whitespace`` true is the pattern ``""`` (no whitespace) for a
JSON constraint; with another one it has nothing to do.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, field_validator, model_validator)

from ..chat_template import media_keys, quoted_ids, unanswered_calls
from ..errors import DFlashError
from ..options import json_type, non_finite, strict_json, tool_name_error
from ..sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS
from .constraints import strict_schema

MAX_STOP_STRINGS = 16
MAX_N = 128  # OpenAI's own limit on n
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on logprobs of /v1/completions (top_logprobs of chat: 20)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's json_schema.name
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs
JSONSchema = dict[StrictStr, Any] | StrictBool  # (true and false are JSON schemas too)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the usage) and vLLM's
    ``continuous_usage_stats`` (with ``include_usage``, every chunk has the usage so far);
    OpenAI's ``include_obfuscation`` is accepted (the chunks carry no ``obfuscation``)."""
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = frozenset({"include_obfuscation"})
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``name`` (required), ``description``,
    ``schema`` (required here: without one there is nothing to constrain to) and ``strict``
    (the output always matches the schema; ``strict: true`` also holds each object to the keys
    its schema declares, as OpenAI's strict mode: :func:`~.constraints.strict_schema`, applied
    to ``schema`` when the format is read)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr
    description: StrictStr | None = None
    schema_: JSONSchema = Field(..., alias="schema")
    strict: StrictBool | None = None

    @field_validator("name", mode="after")
    @classmethod
    def _name(cls, name: str) -> str:
        if not SCHEMA_NAME.fullmatch(name):
            raise ValueError(f"must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got {name[:80]!r}")
        return name

    @model_validator(mode="after")
    def _strict_objects(self):
        """``strict: true``: an object schema in ``schema`` takes no keys but those it declares
        where :func:`~.constraints.strict_schema` can hold it to them (trial-277: ``{"a": 0, "b": -1,
        "bb": -1, "bb": -1}`` for ``properties`` a and b, valid JSON Schema, not what a strict
        schema means)."""
        if self.strict:
            try:
                self.schema_ = strict_schema(self.schema_)
            except DFlashError as exc:
                raise ValueError(str(exc)) from None
        return self


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (``json_schema.schema``); a ``json_schema`` field beside
    another type is ignored, unread (as that type ignores it)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _schema_of_its_type(cls, data):
        """(trial-277: ``{"type": "json_object", "json_schema": {"name": "x"}}`` was a 400 about
        the missing ``json_schema.schema``, a field json_object does not read)"""
        if isinstance(data, dict) and data.get("type") in ("text", "json_object") and "json_schema" in data:
            return {k: v for k, v in data.items() if k != "json_schema"}
        return data

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object (with name and schema)")
        return self

    def structured_output(self) -> dict | None:
        """The constraint as :class:`~dflash_torch.structured.StructuredOutput`'s dict form (None: text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        return None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema or its JSON text),
    ``regex``, ``choice``, ``grammar`` (llguidance's Lark syntax) and ``json_object``
    (true); ``whitespace_pattern``: a JSON constraint's whitespace (a regex);
    ``disable_any_whitespace`` true: none (the whitespace pattern ``""``; a JSON-only option,
    so with another kind of constraint it has nothing to do). vLLM's options for its other
    backends (``disable_fallback``, ...) are ignored; ``structural_tag`` is refused."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    ALSO_KNOWN: ClassVar[frozenset[str]] = frozenset({"disable_fallback", "disable_additional_properties"})
    json_: JSONSchema | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    whitespace_pattern: StrictStr | None = None
    disable_any_whitespace: StrictBool | None = None
    structural_tag: Any = None

    def given(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if (self.json_object if k == "json_object" else
                                                 getattr(self, "json_" if k == "json" else k) is not None)]

    def structured_output(self) -> dict:
        """The one constraint given, in :class:`~dflash_torch.structured.StructuredOutput`'s dict form."""
        kind = self.given()[0]
        return {kind: getattr(self, "json_" if kind == "json" else kind)}


class _Request(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore")
    samples: ClassVar[bool] = True  # its sampling fields are checked (:func:`conflicting_fields`, :func:`unsupported_field`)

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=0)  # (0: completions with echo only, see conflicting_fields)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2, allow_inf_nan=False)  # (NaN: "a finite number")
    top_p: StrictFloat | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)  # extension; -1 and 0 mean off
    min_p: StrictFloat | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # extension (vLLM); 0 = off
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = Field(None)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM-style)
    ignore_eos: StrictBool = False
    stop_token_ids: StrictInt | list[StrictInt] | None = None  # an id or a list, as in DFlashEngine.generate
    n: StrictInt | None = Field(1, ge=1, le=MAX_N)  # choices per prompt
    # candidates per prompt (legacy completions): only best_of == n, which returns them all
    best_of: StrictInt | None = Field(None, ge=1)
    presence_penalty: StrictFloat | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: StrictFloat | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: StrictFloat | None = Field(None, gt=0, allow_inf_nan=False)  # extension (vLLM); 1 = off
    # token id (a decimal string, as JSON keys are) -> bias; ids past the vocabulary, one token twice: the engine's 400
    logit_bias: dict[StrictStr, Annotated[StrictFloat, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS,
                                                            allow_inf_nan=False)]] | None = None
    min_tokens: StrictInt = Field(0, ge=0)  # extension (vLLM): no stop token (nor stop string) before that many
    # extensions (vLLM's; vLLM skips special tokens by default, this server keeps them unless asked)
    skip_special_tokens: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    # structured outputs: OpenAI's field, vLLM's, and vLLM's older ones (at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JSONSchema | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None  # (vLLM: the whitespace of a JSON constraint)
    # vLLM's extension: each prompt token's logprob and this many alternatives (choices[i].prompt_logprobs)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # known but only their defaults are honoured
    user: StrictStr | None = None

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """The keys are token ids: decimal digits only (``"50256"``; not ``"-1"``, ``" 5"``, ``"5.0"``),
        at most 18 past leading zeros (longer ones are no vocabulary's). They stay strings: the
        engine reads them as ids (:class:`~dflash_torch.sampling.SamplingParams`), and refuses one
        token given twice (``"5"`` and ``"05"``) or an id past the vocabulary, a 400 before the
        request queues."""
        if bias is None:
            return None
        bad = next((k for k in bias if not (k.isascii() and k.isdigit())), None)
        if bad is not None:
            raise ValueError(f"keys must be token ids (decimal integers >= 0 as strings), got {bad!r}")
        huge = next((d for d in (k.lstrip("0") for k in bias) if len(d) > 18), None)
        if huge is not None:  # (int() refuses strings of over 4300 digits; the message leaves it out)
            raise ValueError(f"keys must be token ids in the vocabulary, got one of {len(huge)} digits")
        return bias

    def constraints(self) -> list[tuple[str, dict]]:
        """``(param, structured output)`` of each structured-output field given (a valid
        request has at most one): the constraint in
        :class:`~dflash_torch.structured.StructuredOutput`'s dict form and the field it came from."""
        out = []
        if self.response_format is not None and self.response_format.structured_output() is not None:
            out.append(("response_format", self.response_format.structured_output()))
        if self.structured_outputs is not None and self.structured_outputs.given():
            out.append(("structured_outputs", self.structured_outputs.structured_output()))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                out.append((f"guided_{kind}", {kind: value}))
        return out

    def constraint(self) -> tuple[str, dict] | None:
        """The request's one structured output as ``(param, structured output)`` (see
        :meth:`constraints`), None for none."""
        found = self.constraints()
        return found[0] if found else None

    def whitespace_patterns(self) -> list[tuple[str, str]]:
        """``(param, regex)`` of each JSON whitespace pattern given (vLLM's
        ``guided_whitespace_pattern``, ``structured_outputs.whitespace_pattern``; a valid
        request has at most one)."""
        out = []
        if self.guided_whitespace_pattern is not None:
            out.append(("guided_whitespace_pattern", self.guided_whitespace_pattern))
        if self.structured_outputs is not None and self.structured_outputs.whitespace_pattern is not None:
            out.append(("structured_outputs", self.structured_outputs.whitespace_pattern))
        return out

    def whitespace_pattern(self) -> tuple[str, str] | None:
        """``(param, regex)``: the whitespace between the tokens of the request's JSON
        constraint (a JSON schema or ``json_object``; see :meth:`whitespace_patterns`), None for none;
        ``structured_outputs.disable_any_whitespace`` true is the pattern ``""`` for a JSON
        constraint (none for another kind: it has no JSON whitespace to disable)."""
        found = self.whitespace_patterns()
        if found:
            return found[0]
        constraint = self.constraint()
        if self.structured_outputs is not None and self.structured_outputs.disable_any_whitespace and \
                constraint is not None and next(iter(constraint[1])) in ("json", "json_object"):
            return "structured_outputs", ""
        return None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_kwargs(self, defaults: dict | None = None) -> dict:
        """Keyword arguments of :meth:`DFlashEngine.stream` (``max_new_tokens`` excluded).
        ``defaults``: the values of ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
        ``repetition_penalty`` for a request that omits them (the model's generation config,
        :attr:`DFlashEngine.generation_defaults`); else OpenAI's (1, off, 1, off, off)."""
        return dict(
            **self.sampling_values(defaults),
            seed=self.seed,
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            stop=self.stop_list() or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.engine_logprobs(),
            prompt_logprobs=self.engine_prompt_logprobs(),
        )

    def sampling_values(self, defaults: dict | None = None) -> dict:
        """``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` as served: the request's,
        else ``defaults``' (see :meth:`sampling_kwargs`), else OpenAI's."""
        out = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
        for name in out:
            value = getattr(self, name)
            if value is None:
                value = (defaults or {}).get(name)
            if value is not None:
                out[name] = max(0, value) if name == "top_k" else float(value)  # (top_k -1: off)
        return out

    def engine_logprobs(self) -> int | None:
        """``logprobs`` of :meth:`DFlashEngine.stream`: alternatives per token, None for none."""
        return None

    def engine_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs`` of :meth:`DFlashEngine.stream`: alternatives per prompt token
        (enough for every field that reports them), None for none."""
        return self.prompt_logprobs

    def scores_only(self) -> bool:
        """Whether nothing is to be generated (completions ``echo`` with ``max_tokens`` 0):
        one token is decoded and dropped, the response holds the prompt alone."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): the usage
        so far on every chunk."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def requested_max_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_field())

    def max_tokens_field(self) -> str:
        """The field that sets the request's token budget, as sent (for messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def echo_logprobs(self) -> bool:
        """Whether the legacy ``logprobs`` object covers the prompt's tokens too (``echo`` with ``logprobs``)."""
        return bool(self.echo) and self.logprobs is not None

    def engine_prompt_logprobs(self) -> int | None:
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo_logprobs() else None) if k is not None]
        return max(wanted) if wanted else None

    def scores_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (strings or token-id lists), one or a list of them."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


def no_media(data):
    """A message (before its fields are read) that sends media beside its text (Ollama's
    ``images``, ...: :data:`~dflash_torch.chat_template.MEDIA_KEYS`) is refused: its text alone
    was answered, the image unseen.

    Raises:
        ValueError: naming the first such key."""
    if isinstance(data, dict) and (media := media_keys(data, data.get("role"))):
        raise ValueError(f"the message holds {media[0]!r}: only text is supported (images, audio, video and files "
                         "are not)")
    return data


def check_parts(parts):
    """A message's list ``content`` checked before its parts are read: each an object with a
    string ``type`` and, where it has ``text`` or ``refusal``, a string there (as the part's
    model reads them; otherwise pydantic would name only the union of content's types).

    Raises:
        ValueError: the first part that is not so, named by its index."""
    for j, part in enumerate(parts if isinstance(parts, list) else ()):
        if not isinstance(part, dict):
            raise ValueError(f"part {j} must be a content part (an object with a 'type'), got {json_type(part)}")
        if not isinstance(part.get("type"), str):
            raise ValueError(f"part {j} needs a string 'type'")
        if (part["type"].endswith("text") or part["type"] == "refusal") and (media := media_keys(part)):
            raise ValueError(f"part {j} holds {media[0]!r}: only text is supported")
        for field in ("text", "refusal"):
            if part.get(field) is not None and not isinstance(part[field], str):
                raise ValueError(f"part {j}'s {field!r} must be a string, got {json_type(part[field])}")
    return parts


class ContentPart(BaseModel):
    """A part of a message's list ``content``: ``{"type": "text", "text": ...}``, or in an
    assistant message OpenAI's ``{"type": "refusal", "refusal": ...}``, whose text joins the
    content as a text part's does (as vLLM reads it). Other types (images, audio, files)
    are refused by :meth:`ChatMessage._check_parts`, which names the type."""
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None
    refusal: StrictStr | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    # OpenAI: a JSON object's text (a dict is taken too; "", null and no arguments are {}, as vLLM takes them)
    arguments: StrictStr | dict[StrictStr, Any] | None = Field(None, validate_default=True)

    @field_validator("arguments", mode="after")
    @classmethod
    def _json_object(cls, arguments):
        """A JSON object's text (kept as sent: the engine parses it) or a dict; ``""``,
        None and no ``arguments`` are ``{}`` (a call without arguments, as vLLM and the
        engine take them)."""
        if arguments is None or arguments == "":
            return {}
        if isinstance(arguments, str):
            check_json_object(arguments)
        elif non_finite(arguments):  # (a body's NaN / Infinity: Python's parser takes them)
            raise ValueError(NON_FINITE)
        return arguments


NON_FINITE = "must be a JSON object: it holds NaN or Infinity, which JSON has not"


def check_json_object(text: str) -> None:
    """``text`` is a JSON object's text (a tool call's ``arguments``: the chat template renders it as one).

    Raises:
        ValueError: it is not, in words that follow the field's name."""
    try:
        value = strict_json(text)
    except ValueError as exc:
        raise ValueError(f"must be a JSON object's text: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError("must be a JSON object's text: nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object's text, got {json_type(value)}")


class ToolCall(BaseModel):
    """A call of an earlier assistant message (its ``index``, which clients that joined a
    stream's deltas keep, is not read)."""
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = frozenset({"index"})
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # (OpenAI's fields of an assistant message a client sends back as it got it: not read)
    ALSO_KNOWN: ClassVar[frozenset[str]] = frozenset({"annotations", "audio", "function_call"})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    refusal: StrictStr | None = None  # (an assistant message OpenAI returned: its text, as a refusal part's)
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None  # (role tool: the call it answers)
    # an earlier reply's reasoning, as the server returns it (vLLM's newer name: reasoning)
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    _parts_first = field_validator("content", mode="before")(check_parts)
    _no_media = model_validator(mode="before")(no_media)

    @field_validator("content", mode="after")
    @classmethod
    def _check_parts(cls, content, info):
        """Text parts, and refusal parts in an assistant message, each with its text."""
        role = info.data.get("role")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.type == "refusal" and role not in (None, "assistant"):
                raise ValueError(f"part {j} is a refusal part, which only an assistant message may hold")
            if part.type not in ("text", "refusal"):
                raise ValueError(f"part {j} has type {part.type[:40]!r}: only text parts are supported (and "
                                 f"refusal parts in an assistant message)")
            if getattr(part, part.type) is None:
                raise ValueError(f"part {j} (type {part.type!r}) has no {part.type!r} string")
        return content

    @model_validator(mode="before")
    @classmethod
    def _legacy_call(cls, data):
        """An assistant message holding OpenAI's legacy ``function_call`` (with role ``function``
        results) and no ``tool_calls``: named as such (without content it read 'needs content ...
        tool_calls or a refusal'; with content the call was dropped from the prompt unsaid)."""
        if isinstance(data, dict) and data.get("function_call") is not None and not data.get("tool_calls"):
            raise ValueError("an assistant message's function_call (OpenAI's legacy function calling) is not "
                             "supported: send the call as tool_calls, and its result as a tool message")
        return data

    @model_validator(mode="after")
    def _content_given(self):
        """OpenAI requires ``content`` of every message but an assistant's with ``tool_calls``
        (or, as OpenAI returns a refusal, a ``refusal``): a message without one was rendered
        as an empty turn."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts)")
        if self.content is None and self.role == "assistant" and not self.tool_calls and self.refusal is None:
            raise ValueError("an assistant message needs content (a string or a list of text parts), tool_calls or "
                             "a refusal")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError(f"a {self.role} message has a refusal, which only an assistant message may hold")
        return self

    def text(self) -> str:
        """The message's text: its content's (text and refusal parts joined by newlines, as
        vLLM joins them), then its ``refusal`` (an assistant message's, as OpenAI returns it
        with content null; it was dropped, the reply read as an empty turn)."""
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "\n".join(part.value() for part in self.content)
        return "\n".join(t for t in (text, self.refusal) if t) if self.refusal else text

    def engine_message(self) -> dict:
        """The message for :meth:`DFlashEngine.encode_prompt` ("developer" is OpenAI's newer
        name for "system", the role chat templates know); a tool call's ``arguments`` stay
        as sent (the engine parses a JSON string into a dict); an assistant message's
        ``reasoning_content`` (or ``reasoning``) reaches the template as ``reasoning_content``,
        the name templates read it by (Qwen3's, Gemma 4's)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None and self.role == "assistant":
            out["reasoning_content"] = reasoning
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # (whatever else the client sends reaches the template)
    EXTRA_TO_TEMPLATE: ClassVar[bool] = True
    ALSO_KNOWN: ClassVar[frozenset[str]] = frozenset({"strict"})  # (OpenAI's; it reaches the template too)
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None  # a JSON schema

    @field_validator("name", mode="after")
    @classmethod
    def _name(cls, name: str) -> str:
        """A name a call can give: not empty nor blank. Other names are taken as sent, as vLLM
        takes them (OpenAI's own API allows 1 to 64 characters of a-z, A-Z, 0-9, _ and -; clients
        of other servers send dots and more); two tools of one name: :meth:`ChatCompletionRequest._one_name_each`."""
        if (problem := tool_name_error(name)) is not None:  # (the rule the Python API's check_tools applies)
            raise ValueError(problem)
        return name


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    EXTRA_TO_TEMPLATE: ClassVar[bool] = True
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICES = ("none", "auto", "required")


class FieldError(ValueError):
    """A validator's error about a part of its field: ``param`` the part's path below the
    field (``function.name`` of ``tool_choice``), which :func:`describe_validation_error` names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class UnsupportedValue(FieldError):
    """A :class:`FieldError` about a value of OpenAI's API that this server does not serve
    (``tool_choice`` ``allowed_tools``, a ``custom`` tool): answered with the code
    ``unsupported_parameter`` (:func:`validation_code`), in chat completions as in the
    Responses API."""


def validation_code(exc: ValidationError) -> str | None:
    """The OpenAI error ``code`` of a request's pydantic error ``exc`` (its first, as
    :func:`describe_validation_error` says it): ``unsupported_parameter`` for an
    :class:`UnsupportedValue`, None (an invalid value) otherwise."""
    errors = exc.errors(include_url=False)
    cause = (errors[0].get("ctx") or {}).get("error") if errors else None
    return "unsupported_parameter" if isinstance(cause, UnsupportedValue) else None


def tool_choice_forms(chat: bool) -> str:
    """The words that name the ``tool_choice`` values taken, in chat completions (``chat``) or the Responses API."""
    named = '{"type": "function", "function": {"name": ...}}' if chat else '{"type": "function", "name": ...}'
    return f"tool_choice must be 'none', 'auto', 'required' or {named}"


def check_tool_choice(value, chat: bool):
    """``tool_choice`` as sent, checked before it is typed, so that an error says what is
    wrong with it and names the forms taken: ``"none"``, ``"auto"``, ``"required"`` or a
    named function, ``{"type": "function", "function": {"name": ...}}`` in chat completions
    (``chat``), ``{"type": "function", "name": ...}`` in the Responses API (whose other
    types are refused later, :meth:`ResponsesRequest.unsupported`).

    Raises:
        FieldError: a string not among those, a value neither a string nor an object, or an
            object without its ``type`` or (chat) its ``function.name`` string."""
    forms = tool_choice_forms(chat)
    if value is None or value in TOOL_CHOICES:
        return value
    if isinstance(value, str):
        raise FieldError(f"{forms}; got {value[:40]!r}", "")
    if not isinstance(value, dict):
        raise FieldError(f"{forms}; got {json_type(value)}", "")
    if "type" not in value:
        raise FieldError(f"tool_choice.type is missing; {forms}", "type")
    if not isinstance(value["type"], str):
        raise FieldError(f"tool_choice.type must be a string, got {json_type(value['type'])}; {forms}", "type")
    if not chat:
        if "name" not in value and value["type"] == "function":
            hint = " ({'function': {'name': ...}} is chat completions' form)" if "function" in value else ""
            raise FieldError(f"tool_choice.name is missing{hint}; {forms}", "name")
        if "name" in value and not isinstance(value["name"], str) and (value["type"] == "function" or
                                                                        value["name"] is not None):
            raise FieldError(f"tool_choice.name must be a string, got {json_type(value['name'])}; {forms}", "name")
        return value
    if value["type"] != "function":  # (OpenAI's allowed_tools and custom: not served, as in the Responses API)
        raise UnsupportedValue(f"tool_choice.type must be 'function', got {value['type'][:40]!r}; {forms}", "type")
    function = value.get("function")
    if function is None:
        hint = " ({'name': ...} beside type is the Responses API's form)" if "name" in value else ""
        raise FieldError(f"tool_choice.function is missing{hint}; {forms}", "function")
    if not isinstance(function, dict):
        raise FieldError(f"tool_choice.function must be an object, got {json_type(function)}; {forms}", "function")
    if "name" not in function:
        raise FieldError(f"tool_choice.function.name is missing; {forms}", "function.name")
    if not isinstance(function["name"], str):
        raise FieldError(f"tool_choice.function.name must be a string, got {json_type(function['name'])}; {forms}",
                         "function.name")
    return value


def _answer_fault(fault) -> tuple[str, str]:
    """``(message, param)`` of a chat request's :class:`~dflash_torch.chat_template.CallAnswerFault`."""
    if fault.kind == "twice":
        where = f"messages.{fault.message}.tool_call_id"
        return (f"{where} {quoted_ids(fault.calls)} answers a tool call that messages.{fault.before} already answered (each "
                f"call is answered once)", where)
    before = f"before messages.{fault.before}" if fault.before is not None else \
        "before the messages end (continue_final_message true, with add_generation_prompt false, continues that " \
        "assistant message instead)"
    return (f"messages.{fault.message}: an assistant message with tool_calls must be followed by a tool message "
            f"answering each call (its tool_call_id the call's id) before a message of another role; not answered "
            f"{before}: {quoted_ids(fault.calls)}", f"messages.{fault.message}.tool_calls.{fault.calls[0][0]}")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    echo: StrictBool | None = False  # (vLLM's chat extension: refused, see unsupported_field)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # (false: tool_choice auto returns the reply's first call only, as vLLM; required: the grammar allows one call only)
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[StrictStr] | None = None
    audio: Any = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # (vLLM / SGLang's name)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's: the prompt ends after the opening of the assistant's turn, or (continue_final_message,
    # with add_generation_prompt false) inside the last message, which the reply continues
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: Any = None  # (vLLM's per-request template: refused, see unsupported_field)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        return check_tool_choice(value, chat=True)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools):
        """Function tools only: another type (OpenAI's ``custom``) is not served, said as the
        Responses API says it (:meth:`ResponsesRequest.unsupported`)."""
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise UnsupportedValue(f"only function tools are supported; tools.{i} is {kind[:40]!r}", f"{i}.type")
        return tools

    @model_validator(mode="after")
    def _one_name_each(self):
        """Each function has a name of its own: a call names the function it calls (two different
        tools of one name are refused, naming the second; the same definition twice is taken, as
        :func:`~dflash_torch.options.check_tools` takes it)."""
        first: dict[str, int] = {}
        tools = self.tools or []
        for i, tool in enumerate(tools):
            name = tool.function.name
            if first.setdefault(name, i) != i and \
                    tool.model_dump(exclude_none=True) != tools[first[name]].model_dump(exclude_none=True):
                raise FieldError(f"tools.{first[name]} and tools.{i} are two different tools named {name[:80]!r}: "
                                 "a call of it could mean either; give each its own name", f"tools.{i}.function.name")
        return self

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self):
        """A ``tool`` message answers a tool call of an earlier assistant message: its
        ``tool_call_id`` is required and must be that call's ``id``, as OpenAI checks them (as
        the Responses API checks a function_call_output's ``call_id``); where an earlier call has
        no ``id``, any ``tool_call_id`` may answer it (a client cannot give the id such a call
        lacks). ``tool_calls`` (but an empty list) on a message other than an assistant's, or a
        ``tool_call_id`` on one other than a tool message, is refused naming it (they were
        taken, to the chat template, and the calls' ids answerable). Each call with an ``id``
        is answered by a tool message right after its assistant message (before a message of
        another role or the end of the messages; a last assistant message's calls are taken
        with ``continue_final_message``), and once, as OpenAI checks them
        (:func:`~dflash_torch.chat_template.unanswered_calls`, the Python API's rule: trial-292
        took them unsaid, the model seeing a call without its result)."""
        ids: set[str] = set()
        anonymous = False  # (an earlier call without an id)
        for i, message in enumerate(self.messages):
            a = "an" if message.role == "assistant" else "a"
            if message.tool_calls and message.role != "assistant":
                raise FieldError(f"messages.{i}.tool_calls: {a} {message.role} message has tool_calls, which only an "
                                 f"assistant message may hold", f"messages.{i}.tool_calls")
            if message.tool_call_id is not None and message.role != "tool":
                raise FieldError(f"messages.{i}.tool_call_id: {a} {message.role} message has a tool_call_id, which "
                                 f"only a tool message may hold (it names the call the message answers)",
                                 f"messages.{i}.tool_call_id")
            for call in message.tool_calls or []:
                if call.id is None:
                    anonymous = True
                else:
                    ids.add(call.id)
            if message.role != "tool":
                continue
            where = f"messages.{i}.tool_call_id"
            if message.tool_call_id is None:
                raise FieldError(f"missing required parameter: {where} (a tool message answers the tool call of "
                                 f"that id)", where)
            if message.tool_call_id not in ids and not anonymous:
                raise FieldError(f"{where} {message.tool_call_id[:80]!r} is not the id of a tool call of an earlier "
                                 f"assistant message (a tool message answers one)", where)
        fault = unanswered_calls([{"role": m.role, "tool_calls": [{"id": c.id} for c in m.tool_calls or []],
                                   "tool_call_id": m.tool_call_id} for m in self.messages], self.continue_final_message)
        if fault is not None:  # (the rule of the Python API's chat_messages, in the request's names)
            raise FieldError(*_answer_fault(fault))
        return self

    def prompt_options(self) -> dict:
        """The chat template options of :meth:`DFlashEngine.encode_prompt` this request sets."""
        return {"add_generation_prompt": self.add_generation_prompt, "continue_final_message": self.continue_final_message}

    def template_kwargs(self, defaults: dict | None) -> dict | None:
        """The chat template's extra variables: the server's ``defaults``, then this
        request's ``chat_template_kwargs``, then ``reasoning_effort`` (a variable of
        gpt-oss's template, which knows low, medium and high; others ignore it), mapped by
        :data:`REASONING_EFFORTS`; ``"none"`` also sets ``enable_thinking`` false (Qwen3's
        non-thinking mode) unless the request's own ``chat_template_kwargs`` set it. None
        when there are none."""
        merged = {**(defaults or {}), **(self.chat_template_kwargs or {})}
        if self.reasoning_effort is not None:
            merged["reasoning_effort"] = REASONING_EFFORTS[self.reasoning_effort]
            if self.reasoning_effort == "none" and "enable_thinking" not in (self.chat_template_kwargs or {}):
                merged["enable_thinking"] = False
        return merged or None

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict]:
        return [m.engine_message() for m in self.messages]

    def forces_tool_calls(self) -> bool:
        """``tool_choice`` ``required`` or a named function: the reply must be tool calls."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def engine_tools(self) -> list[dict] | None:
        """The tools for the chat template: the request's, unless ``tool_choice`` is
        ``"none"`` (the model must not call any: it is not told of them); None for none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def conflicting_fields(req: _Request) -> tuple[str, str] | None:
    """``(param, message)`` for values that contradict each other: ``best_of`` < ``n``
    (OpenAI: best_of candidates are generated and the best n returned); chat's
    ``top_logprobs`` without ``logprobs: true``, ``stream_options`` without ``stream``
    (OpenAI refuses them too); ``ignore_eos`` or ``min_tokens`` with a ``tool_choice`` that
    forces a call (the reply ends after it)."""
    n = req.n or 1
    if req.max_tokens == 0 and not req.scores_only():
        return "max_tokens", ("max_tokens must be >= 1 (0 only with echo in /v1/completions: the prompt scored, "
                              "nothing generated)")
    if req.scores_only() and req.min_tokens:
        return "min_tokens", f"min_tokens ({req.min_tokens}) must be 0 with max_tokens 0"
    if req.stream_options is not None and not req.stream:  # (as OpenAI and vLLM answer)
        return "stream_options", "stream_options is only allowed when stream is true"
    if req.best_of is not None and req.best_of < n:
        return "best_of", f"best_of must be >= n (best_of={req.best_of}, n={n})"
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        return "top_logprobs", "top_logprobs needs logprobs set to true"
    if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "none") and not req.tools:
        return "tool_choice", "tool_choice needs tools"
    if req.structured_outputs is not None and req.structured_outputs.structural_tag is None:
        given = req.structured_outputs.given()  # (structural_tag: refused as unsupported, unsupported_field)
        # (none given beside another field's constraint: its options, e.g. whitespace_pattern, apply to that one)
        if not (given or req.constraints()) and req.structured_outputs.json_object is False:  # (sent: not "got none")
            return "structured_outputs", ("structured_outputs.json_object must be true (the output is any JSON "
                                          "object), got false, which asks for no constraint")
        if len(given) > 1 or not (given or req.constraints()):
            return "structured_outputs", (f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}; "
                                          f"got {', '.join(given) or 'none'}")
    found = req.constraints()
    if len(found) > 1:
        return found[1][0], (f"one structured-output constraint per request: {_constraint_name(found[0])} and "
                             f"{_constraint_name(found[1])} both given")
    spaces = req.whitespace_patterns()
    if spaces and req.structured_outputs is not None and req.structured_outputs.disable_any_whitespace:
        name = "structured_outputs.whitespace_pattern" if spaces[0][0] == "structured_outputs" else spaces[0][0]
        return "structured_outputs", (f"structured_outputs.disable_any_whitespace and {name} both given: "
                                      "one JSON whitespace setting per request")
    if len(spaces) > 1:
        return spaces[1][0], ("one JSON whitespace pattern per request: guided_whitespace_pattern and "
                              "structured_outputs.whitespace_pattern both given")
    if spaces and not (found and next(iter(found[0][1])) in ("json", "json_object")) and \
            (req.structured_outputs is None or req.structured_outputs.structural_tag is None):
        param = spaces[0][0]
        name = "structured_outputs.whitespace_pattern" if param == "structured_outputs" else param
        what = f"this request's constraint is {_constraint_name(found[0])}" if found else "this request has none"
        return param, f"{name} sets the whitespace of a JSON constraint (a JSON schema or json_object); {what}"
    if isinstance(req, ChatCompletionRequest) and req.forces_tool_calls():
        if found:
            return "tool_choice", (f"tool_choice {tool_choice_name(req.tool_choice)} constrains the reply to tool "
                                   f"calls; it cannot be combined with {_constraint_name(found[0])}")
        if isinstance(req.tool_choice, NamedToolChoice) and \
                req.tool_choice.function.name not in [tool.function.name for tool in req.tools]:
            return "tool_choice.function.name", (f"tool_choice names the function {req.tool_choice.function.name!r}, "
                                                 "which is "
                                   "not among the request's tools")
        # (the forced call is a constraint the reply ends after: were refused as "a structured output", trial-299 h)
        for name, given in (("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens)):
            if given:
                choice = tool_choice_name(req.tool_choice)
                what = f"{choice[:-1]}: a forced tool call" if choice.endswith(")") else f"{choice} (a forced tool call"
                return name, (f"tool_choice {what}, which the reply ends after) cannot be combined with {name}"
                              + (f" ({given})" if name == "min_tokens" else ""))
    return None


def _constraint_name(found: tuple[str, dict]) -> str:
    """``response_format json_schema``, ``guided_regex``, ``structured_outputs.choice``: a constraint in messages."""
    param, spec = found
    kind = next(iter(spec))
    if param == "response_format":
        return f"response_format {'json_object' if kind == 'json_object' else 'json_schema'}"
    return f"structured_outputs.{kind}" if param == "structured_outputs" else param


def tool_choice_name(choice) -> str:
    """A chat request's ``tool_choice`` in messages: ``'required'``, ``'f' (a named function)``."""
    return f"{choice.function.name!r} (a named function)" if isinstance(choice, NamedToolChoice) else repr(choice)


CHAT_TEMPLATE_REFUSED = "chat_template is not supported: chats are rendered with the model's own chat template"


def unknown_fields(req: BaseModel, data: dict) -> tuple[list[str], list[str]]:
    """The fields of a request body ``data`` that its model ``req`` (``data`` validated) does
    not know, named by their path (``max_token``, ``text.fromat``, ``messages[].nmae``: ``[]``
    for any item of a list), each once (an object's own before those in its fields):
    ``(ignored, passed on)``, the
    latter those of a model that hands what it does not know to the chat template as sent
    (``EXTRA_TO_TEMPLATE``: a tool's function). A model's fields, their aliases and its
    ``ALSO_KNOWN`` (fields clients send that it does not read) are known. The objects that
    the request's models took are walked; free-form ones (a tool's ``parameters``, a JSON
    schema, ``metadata``, ``logit_bias``, ``chat_template_kwargs``, a call's ``arguments``,
    ...: not models) are not."""
    ignored: dict[str, None] = {}
    passed: dict[str, None] = {}
    _unknown_fields(req, data, "", ignored, passed)
    return list(ignored), list(passed)


def known_fields(cls: type[BaseModel]) -> set[str]:
    """The request fields the model ``cls`` knows: its fields, their aliases and its
    ``ALSO_KNOWN`` (fields clients send that it does not read)."""
    fields = cls.model_fields
    return set(fields) | {f.alias for f in fields.values() if f.alias} | getattr(cls, "ALSO_KNOWN", frozenset())


def _unknown_fields(model: BaseModel, data: dict, path: str, ignored: dict, passed: dict) -> None:
    cls = type(model)
    fields = cls.model_fields
    known = known_fields(cls)
    found = passed if getattr(cls, "EXTRA_TO_TEMPLATE", False) else ignored
    for key in data:
        if key not in known:
            found.setdefault(path + key[:80], None)
    for name, info in fields.items():
        key = info.alias if info.alias is not None and info.alias in data else name
        raw, value = data.get(key), getattr(model, name)
        if isinstance(value, BaseModel) and isinstance(raw, dict):
            _unknown_fields(value, raw, f"{path}{key}.", ignored, passed)
        elif isinstance(value, list) and isinstance(raw, list) and len(value) == len(raw):
            for item, raw_item in zip(value, raw):
                if isinstance(item, BaseModel) and isinstance(raw_item, dict):
                    _unknown_fields(item, raw_item, f"{path}{key}[].", ignored, passed)
    for where, item, raw_item in getattr(model, "_validated_items", None) or ():  # (ResponsesRequest's, validated apart)
        _unknown_fields(item, raw_item, f"{path}{where}.", ignored, passed)


def unsupported_field(req: _Request) -> tuple[str, str] | None:
    """``(param, message)`` for the first field whose value the engine cannot honour.

    ``best_of`` == ``n`` asks for every candidate: it is served as ``n`` alone; a larger
    ``best_of`` would need candidates ranked, which the server does not do."""
    n = req.n or 1
    checks: list[tuple[str, bool, str]] = [
        ("best_of", req.best_of is not None and req.best_of > n,
         f"best_of > n is not supported (best_of={req.best_of}, n={n}): candidates are not ranked; "
         "use n, or best_of equal to n"),
        ("stop", len(req.stop_list()) > MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are supported"),
        ("structured_outputs", req.structured_outputs is not None and req.structured_outputs.structural_tag is not None,
         "structured_outputs.structural_tag is not supported (json, regex, choice, grammar or json_object are)"),
    ]
    if isinstance(req, CompletionRequest):
        checks += [
            ("suffix", bool(req.suffix), "suffix is not supported"),
        ]
    if isinstance(req, ChatCompletionRequest):
        checks += [
            ("functions", bool(req.functions), "functions are not supported"),
            ("function_call", req.function_call not in (None, "none"), "function_call is not supported"),
            ("modalities", req.modalities not in (None, ["text"]), "only the text modality is supported"),
            ("audio", req.audio is not None, "audio output is not supported"),
            ("echo", bool(req.echo), "echo is not supported in chat completions (it is in /v1/completions)"),
            ("chat_template", req.chat_template is not None, CHAT_TEMPLATE_REFUSED),
        ]
    for param, bad, message in checks:
        if bad:
            return param, message
    return None


def _is_union_tag(x) -> bool:
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or "[" in x)


# a union member's pydantic tag -> what it accepts, in JSON's words (one, several); a model not named: an object
_TAG_WORDS = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
              "bool": ("a boolean", "booleans"), "none": ("null", "nulls"), "ContentPart": ("a content part", "content parts"),
              "_Part": ("a content part", "content parts")}


def _tag_words(tag: str, plural: bool = False) -> str:
    """A union member's pydantic tag (``str``, ``list[ContentPart]``, ``dict[str,any]``,
    ``literal['a','b']``) in JSON's words: ``a string``, ``an array of content parts``, ``an
    object``, ``'a' or 'b'`` (``plural``: ``strings``, ``arrays of content parts``, ``objects``)."""
    if tag.startswith("list[") and tag.endswith("]"):
        return ("arrays of " if plural else "an array of ") + _tag_words(tag[5:-1], plural=True)
    if tag.startswith("literal[") and tag.endswith("]"):
        return _one_of(tag[8:-1].split(","))
    words = _TAG_WORDS.get(tag, ("an object", "objects"))  # (dict[...], a model)
    return words[plural]


def _one_of(words: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


# pydantic's errors of a value of the wrong JSON type -> what the field takes, in JSON's words
_EXPECTED = {"list_type": "an array", "dict_type": "an object", "model_type": "an object",
             "model_attributes_type": "an object", "string_type": "a string", "bool_type": "true or false",
             "int_type": "an integer", "float_type": "a number"}


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter (dotted path) of a pydantic error."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = err.get("loc", ())
    param = ".".join(str(x) for x in loc if not _is_union_tag(x)) or None
    if err.get("type") == "missing":
        return f"missing required parameter: {param}", param
    tags = [x for x in loc if _is_union_tag(x)]
    if tags:  # a union: list what it accepts instead of the first member's complaint
        depth = loc.index(tags[0])
        accepted = []
        for e in errors:
            eloc = e.get("loc", ())
            if eloc[:depth] == loc[:depth] and len(eloc) > depth and _is_union_tag(eloc[depth]) and eloc[depth] not in accepted:
                accepted.append(eloc[depth])
        param = ".".join(str(x) for x in loc[:depth]) or None
        # (the value itself: the input of a member's error at the union, not at an item inside it)
        value = next((e.get("input") for e in errors if len(e.get("loc", ())) == depth + 1 and
                      e["loc"][:depth] == loc[:depth]), err.get("input"))
        expected = _one_of([_tag_words(tag) for tag in accepted])
        return f"invalid value for {param}: expected {expected}, got {json_type(value)}", param
    kind, value = err.get("type"), err.get("input")
    if kind in _EXPECTED and param:  # (a wrong JSON type: said in JSON's words, as a union's is)
        return f"invalid value for {param}: expected {_EXPECTED[kind]}, got {json_type(value)}", param
    if kind == "literal_error" and param:
        got = repr(value[:80]) if isinstance(value, str) else json_type(value)
        return f"invalid value for {param}: expected {(err.get('ctx') or {}).get('expected')}, got {got}", param
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")  # (pydantic's word for a validator's ValueError)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # (a validator that names the part of its field, in its own words)
        return msg, ".".join(p for p in (param, cause.param) if p) or None
    return (f"invalid value for {param}: {msg}" if param else msg), param


# --- the Responses API (POST /v1/responses) -----------------------------------------------------

# OpenAI's values of a Responses request's include (the openai package's ResponseIncludable): the outputs of
# hosted tools and images, which this server never makes, and the reasoning's encrypted_content, which it does not
# make either (its reasoning items carry their text), are taken and have nothing to add; the logprobs are refused
RESPONSE_INCLUDABLES = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                        "message.input_image.image_url", "computer_call_output.output.image_url",
                        "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
# vLLM-style extensions a Responses request may carry; typed (and refused) by the chat request it becomes
RESPONSES_EXTENSIONS = ("seed", "stop", "top_k", "min_p", "logit_bias", "repetition_penalty", "presence_penalty",
                        "frequency_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "chat_template_kwargs",
                        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                        "guided_whitespace_pattern", "skip_special_tokens", "include_stop_str_in_output")
TEXT_PART_TYPES = ("input_text", "output_text", "text")  # (text parts of an input message's content)
# a chat request's parameters -> the Responses request's (in the errors of the chat machinery)
RESPONSES_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort", "messages": "input",
                    "prompt": "input"}


class ResponsesInputError(Exception):
    """An input item the Responses request cannot take: ``param`` names it (``input.3.content``)."""

    def __init__(self, param: str, message: str, unsupported: bool = False):
        super().__init__(message)
        self.param, self.message, self.unsupported = param, message, unsupported


# (the fields of OpenAI's output items and parts that a client sends back as input: not read)
_OUTPUT_ITEM_FIELDS = frozenset({"id", "status"})


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = frozenset({"annotations", "logprobs"})
    type: StrictStr
    text: StrictStr | None = None
    refusal: StrictStr | None = None  # (an assistant message's refusal part: OpenAI's output content)


class _InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = _OUTPUT_ITEM_FIELDS
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[_Part]

    _parts_first = field_validator("content", mode="before")(check_parts)
    _no_media = model_validator(mode="before")(no_media)


class _FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = _OUTPUT_ITEM_FIELDS
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr | None = None  # (null or none: {}, as chat's)


class _FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = _OUTPUT_ITEM_FIELDS
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[_Part]

    _parts_first = field_validator("output", mode="before")(check_parts)
    _no_media = model_validator(mode="before")(no_media)  # (media beside the output: refused, as a message's)


class _ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ALSO_KNOWN: ClassVar[frozenset[str]] = _OUTPUT_ITEM_FIELDS | {"encrypted_content"}
    type: Literal["reasoning"]
    content: list[_Part] | None = None
    summary: list[_Part] | None = None

    _parts_first = field_validator("content", "summary", mode="before")(check_parts)
    _no_media = model_validator(mode="before")(no_media)


_ITEMS = {"message": _InputMessage, "function_call": _FunctionCallItem, "function_call_output": _FunctionCallOutputItem,
          "reasoning": _ReasoningItem}
# item types of OpenAI's that need what this server does not have: kept state, hosted tools, other modalities
_STATEFUL_ITEMS = {"item_reference": "an item_reference needs stored responses; this server keeps none (send the item itself)"}


def _parts_text(parts: str | list[_Part], where: str, role: str | None = None) -> str:
    """The text of ``parts``: text parts, and in an assistant message (``role``) refusal
    parts (``refusal``: its text, as chat's refusal parts, see :class:`ContentPart`)."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type == "refusal" and role != "assistant":
            raise ResponsesInputError(f"{where}.{j}.type", f"{where}.{j} is a refusal part, which only an assistant "
                                                            f"message may hold")
        if part.type not in TEXT_PART_TYPES + ("reasoning_text", "summary_text", "refusal"):
            raise ResponsesInputError(f"{where}.{j}.type", f"only text content is supported (input_text, output_text); "
                                                            f"{where}.{j} is {part.type[:40]!r}", unsupported=True)
        field = "refusal" if part.type == "refusal" else "text"
        if getattr(part, field) is None:
            raise ResponsesInputError(f"{where}.{j}.{field}", f"missing required parameter: {where}.{j}.{field}")
        texts.append(getattr(part, field))
    return "\n".join(texts)  # (as chat content parts, see ChatMessage.text)


def _validate_item(schema, item: dict, where: str):
    try:
        return schema.model_validate(item)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        full = f"{where}.{param}" if param else where
        if param:
            message = message.replace(param, full, 1)
        else:
            message = f"invalid value for {where}: {message}"
        raise ResponsesInputError(full, message) from None


def _check_arguments(arguments: str | None, where: str) -> None:
    """A function_call item's ``arguments``: a JSON object's text, or ``""``, None or none
    (``{}``, as chat's)."""
    if arguments is None or arguments == "":
        return
    try:
        check_json_object(arguments)
    except ValueError as exc:
        raise ResponsesInputError(where, f"{where} {exc}") from None


class InputSources:
    """Where the chat messages of a Responses request came from: ``messages[m]`` the input
    field of message ``m`` (``instructions``, ``input`` for a string input, ``input.3``),
    ``calls[m][j]`` the ``function_call`` item of its tool call ``j``."""

    def __init__(self, messages: list[str]):
        self.messages = messages
        self.calls: dict[int, list[str]] = {}

    def item(self, message: int, call: int | None = None) -> str:
        """The input field of chat message ``message`` (of its tool call ``call``); ``input`` if unknown."""
        if call is not None:
            calls = self.calls.get(message, [])
            return calls[call] if 0 <= call < len(calls) else "input"
        return self.messages[message] if 0 <= message < len(self.messages) else "input"


class ResponsesTool(BaseModel):
    """A tool of a Responses request: OpenAI's flat function tool (``type``, ``name``,
    ``description``, ``parameters``, ``strict``); other types are refused (:meth:`ResponsesRequest.unsupported`)."""

    model_config = ConfigDict(extra="allow")
    EXTRA_TO_TEMPLATE: ClassVar[bool] = True  # (chat_tool: as a chat tool's function's)
    type: StrictStr
    name: StrictStr | None = None
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None
    strict: StrictBool | None = None

    def chat_tool(self) -> dict:
        """The tool in chat completions' shape (``{"type": "function", "function": {...}}``)."""
        function = {k: v for k, v in self.model_dump(exclude={"type"}).items() if v is not None}
        return {"type": "function", "function": function}

    def echo(self) -> dict:
        return {"type": "function", "name": self.name, "description": self.description, "parameters": self.parameters,
                "strict": self.strict, **(self.model_extra or {})}


class ResponsesToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    name: StrictStr | None = None


class ResponsesTextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat: ``name``,
    ``schema``, ``description``, ``strict``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: JSONSchema | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @field_validator("name", mode="after")
    @classmethod
    def _name(cls, name: str | None) -> str | None:
        if name is not None and not SCHEMA_NAME.fullmatch(name):
            raise ValueError(f"must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got {name[:80]!r}")
        return name

    @model_validator(mode="before")
    @classmethod
    def _not_nested(cls, data):
        if isinstance(data, dict) and isinstance(data.get("json_schema"), dict) and "schema" not in data:
            raise ValueError("a json_schema format is flat ({'type': 'json_schema', 'name': ..., 'schema': ...}), "
                             "not nested under 'json_schema' as in chat completions")  # (trial-240)
        return data

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type json_schema needs a name and a schema")
        return self

    def response_format(self) -> dict:
        """Chat completions' ``response_format`` of this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echo(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_, "description": self.description,
                "strict": self.strict}


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # (a hint: accepted, echoed, not acted on)


# OpenAI's reasoning efforts -> the chat template's reasoning_effort (low, medium, high: gpt-oss's
# template's values); "none" also turns thinking off (enable_thinking false: Qwen3's templates; others
# ignore it). Chat's reasoning_effort and Responses' reasoning.effort alike.
REASONING_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                     "xhigh": "high"}


class ResponsesStreamOptions(BaseModel):
    """``stream_options`` of a Responses request: OpenAI's ``include_obfuscation`` (accepted; the
    events carry no ``obfuscation``); chat's ``include_usage`` is refused (:meth:`ResponsesRequest.chat_only`)."""
    model_config = ConfigDict(extra="allow")
    include_obfuscation: StrictBool | None = None


_LOGPROBS = "logprobs are not supported in /v1/responses (they are in /v1/chat/completions)"
# parameters of Chat Completions / Completions (and vLLM's extensions of them) that the Responses
# API does not have -> what to send instead: refused with a 400 naming them (ResponsesRequest.chat_only)
CHAT_ONLY_PARAMS = {
    "messages": "use input (a string, or a list of message, function_call and function_call_output items)",
    "max_tokens": "use max_output_tokens",
    "max_completion_tokens": "use max_output_tokens",
    "response_format": "use text.format (e.g. {'type': 'json_schema', 'name': ..., 'schema': ...}, flat)",
    "reasoning_effort": "use reasoning.effort",
    "n": "a request has one response (send one request per response)",
    "logprobs": _LOGPROBS,
    "prompt_logprobs": _LOGPROBS,
    "echo": "it is a /v1/completions parameter",
    "suffix": "it is a /v1/completions parameter",
    "best_of": "a request has one response (send one request per response)",
    "functions": "use tools (flat function tools: {'type': 'function', 'name': ..., 'parameters': ...})",
    "function_call": "use tool_choice",
    "modalities": "the output is text",
    "audio": "the output is text",
    "continue_final_message": "it is a /v1/chat/completions parameter (a response is a new assistant turn)",
    "add_generation_prompt": "it is a /v1/chat/completions parameter (a response is a new assistant turn)",
    "chat_template": "it is a /v1/chat/completions parameter (" + CHAT_TEMPLATE_REFUSED.split(": ", 1)[1] + ")",
}
CHAT_ONLY_STREAM_OPTIONS = {"include_usage": "the usage is always in the last event (response.completed or "
                                             "response.incomplete)"}


class ResponsesReasoning(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # (REASONING_EFFORTS)
    summary: Literal["auto", "concise", "detailed"] | None = None  # (accepted: the reasoning comes whole, summary [])
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (its older name)


class ResponsesRequest(BaseModel):
    """A ``POST /v1/responses`` request (OpenAI's Responses API, stateless): it is served
    as the chat completion :meth:`chat_request` makes of it (the same template, sampling,
    parsers and constraints). Parameters of Chat Completions (or Completions) that are not the
    Responses API's are refused, naming the Responses equivalent (:meth:`chat_only`); other
    fields the server does not know are ignored (as newer OpenAI parameters); OpenAI's
    fields that need kept state or hosted tools are refused (:meth:`unsupported`)."""

    model_config = ConfigDict(extra="allow")  # (model_extra: the fields it does not know, see chat_only)

    model: StrictStr | None = None
    input: StrictStr | list[dict[StrictStr, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Any = None  # (typed by the chat request)
    top_p: Any = None
    stream: StrictBool | None = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[StrictStr] | None = None  # (RESPONSE_INCLUDABLES; logprobs refused, see unsupported)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tool_calls: StrictInt | None = Field(None, ge=1)
    prompt: Any = None  # (a stored prompt template)
    # vLLM-style extensions (RESPONSES_EXTENSIONS; typed by the chat request)
    seed: Any = None
    stop: Any = None
    top_k: Any = None
    min_p: Any = None
    logit_bias: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    chat_template_kwargs: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    _chat: Any = PrivateAttr(None)  # (the chat request it is served as, once checked)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value):
        """``input``: a string or an array of input items (objects), said in those words (the
        union's member types named no input items).

        Raises:
            ValueError, FieldError: anything else (naming the first item that is not an object)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"expected a string or an array of input items, got {json_type(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise FieldError(f"invalid value for input.{i}: expected an input item (an object), got "
                                 f"{json_type(item)}", str(i))
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        return check_tool_choice(value, chat=False)

    @field_validator("include", mode="after")
    @classmethod
    def _include(cls, include: list[str] | None) -> list[str] | None:
        """OpenAI's values only (:data:`RESPONSE_INCLUDABLES`; a misspelt one asked for nothing)."""
        bad = next((value for value in include or () if value not in RESPONSE_INCLUDABLES), None)
        if bad is not None:
            raise ValueError(f"{bad[:80]!r} is not one of the Responses API's include values, "
                             f"{_one_of([repr(v) for v in RESPONSE_INCLUDABLES])}")
        return include

    _sources: Any = PrivateAttr(None)  # (InputSources of its chat messages, once made)
    # (the objects validated apart, for unknown_fields: ("input[]", item, the item's dict), and
    # ("structured_outputs", the chat request's, the dict sent))
    _validated_items: Any = PrivateAttr(None)

    def chat_only(self) -> tuple[str, str] | None:
        """``(param, message)`` of the first parameter sent that is Chat Completions' (or
        Completions') and not the Responses API's (:data:`CHAT_ONLY_PARAMS`), None for none."""
        for name in self.model_extra or {}:
            if name in CHAT_ONLY_PARAMS:
                return name, f"{name} is not a Responses parameter; {CHAT_ONLY_PARAMS[name]}"
        if self.stream_options is not None:
            for name in self.stream_options.model_extra or {}:
                if name in CHAT_ONLY_STREAM_OPTIONS:
                    return f"stream_options.{name}", (f"stream_options.{name} is not a Responses parameter; "
                                                      f"{CHAT_ONLY_STREAM_OPTIONS[name]}")
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` of the first field this server cannot honour: state
        (``store`` true, ``previous_response_id``, ``conversation``, ``background``, ``prompt``),
        tools other than functions, ``truncation`` ``auto``, logprobs, ``max_tool_calls``."""
        stateless = "this server keeps no state (every request is stateless): "
        checks = [
            ("store", self.store is True, stateless + "store must be false or absent"),
            ("previous_response_id", self.previous_response_id is not None,
             stateless + "previous_response_id is not supported; send the whole conversation in input"),
            ("conversation", self.conversation is not None,
             stateless + "conversation is not supported; send the whole conversation in input"),
            ("background", self.background is True, stateless + "background responses are not supported"),
            ("prompt", self.prompt is not None, stateless + "stored prompt templates are not supported"),
            ("truncation", self.truncation == "auto",
             "truncation 'auto' is not supported (the input is never cut); use 'disabled'"),
            ("top_logprobs", bool(self.top_logprobs), "logprobs are not supported in /v1/responses "
                                                      "(they are in /v1/chat/completions)"),
            ("include", "message.output_text.logprobs" in (self.include or []),
             "include message.output_text.logprobs is not supported (logprobs are in /v1/chat/completions)"),
            ("max_tool_calls", self.max_tool_calls is not None, "max_tool_calls is not supported"),
        ]
        for i, tool in enumerate(self.tools or []):
            checks.append((f"tools.{i}.type", tool.type != "function",
                           f"only function tools are supported; tools.{i} is {tool.type[:40]!r}"))
        if isinstance(self.tool_choice, ResponsesToolChoice):
            checks.append(("tool_choice.type", self.tool_choice.type != "function",
                           f"{tool_choice_forms(chat=False)}; {self.tool_choice.type[:40]!r} is not supported"))
        for param, bad, message in checks:
            if bad:
                return param, message
        return None

    def missing(self) -> str | None:
        """A required parameter of a nested object that is not given (the types that allow it
        unset are refused first, by :meth:`unsupported`)."""
        for i, tool in enumerate(self.tools or []):
            if tool.name is None:
                return f"tools.{i}.name"
        return None  # (tool_choice's name: checked as sent, see check_tool_choice)

    def input_messages(self) -> list[dict]:
        """The conversation as chat messages (:meth:`DFlashEngine.encode_prompt`'s):
        ``instructions`` as a system message first, then the input items; ``developer``
        is ``system``; consecutive ``function_call`` items (with the assistant message
        just before them) are one assistant message with ``tool_calls``, and so are
        ``function_call`` items with only ``reasoning`` items between them (one assistant
        turn: OpenAI's reasoning between parallel calls; the reasoning after the first call
        joins the message's ``reasoning_content``, after a newline); a
        ``function_call_output`` is a ``tool`` message (its ``call_id`` must be an earlier
        ``function_call``'s, as OpenAI checks; each ``function_call`` has one output, after
        it and before the next message item, or a ``function_call`` after outputs, which
        starts a new assistant message: chat's rule,
        :func:`~dflash_torch.chat_template.unanswered_calls`); a ``reasoning`` item's text is the
        ``reasoning_content`` of the assistant message that follows it (templates such as
        Qwen3's render it within the current turn).

        Raises:
            ResponsesInputError: an item of a type not supported, or malformed.
        """
        return self._input_messages()[0]

    def _input_messages(self) -> tuple[list[dict], InputSources]:
        """:meth:`input_messages` and where each message (and tool call) came from."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        sources = InputSources([] if self.instructions is None else ["instructions"])
        self._validated_items = []
        if isinstance(self.input, str):
            sources.messages.append("input")
            return messages + [{"role": "user", "content": self.input}], sources
        if not self.input:
            raise ResponsesInputError("input", "input must not be empty")
        reasoning: list[str] = []  # (reasoning items waiting for their assistant message)
        call_ids: set[str] = set()  # (of the function_call items so far)
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            kind = item.get("type", "message")
            if kind in _STATEFUL_ITEMS:
                raise ResponsesInputError(f"{where}.type", _STATEFUL_ITEMS[kind], unsupported=True)
            if kind not in _ITEMS:
                raise ResponsesInputError(f"{where}.type", f"input item type {str(kind)[:40]!r} is not supported "
                                                            f"(message, function_call, function_call_output and "
                                                            f"reasoning are)", unsupported=True)
            parsed = _validate_item(_ITEMS[kind], item, where)
            self._validated_items.append(("input[]", parsed, item))
            if kind == "reasoning":
                reasoning.append(_parts_text(parsed.content or [], f"{where}.content"))
                continue
            if kind == "function_call":
                _check_arguments(parsed.arguments, f"{where}.arguments")
                call_ids.add(parsed.call_id)
                call = {"id": parsed.call_id, "type": "function",
                        "function": {"name": parsed.name, "arguments": parsed.arguments or ""}}
                last = messages[-1] if messages else None
                # (the same turn: calls after the assistant message just before them, or after its calls with only
                # reasoning items between: OpenAI's reasoning between parallel calls, trial-299 b)
                if last is not None and last["role"] == "assistant" and (not reasoning or last.get("tool_calls")):
                    if "".join(reasoning):
                        last["reasoning_content"] = "\n".join(t for t in (last.get("reasoning_content"),
                                                                          "".join(reasoning)) if t)
                    reasoning = []
                    last.setdefault("tool_calls", []).append(call)
                    sources.calls.setdefault(len(messages) - 1, []).append(where)
                    continue
                message = {"role": "assistant", "content": "", "tool_calls": [call]}  # (content: as chat's)
                sources.calls[len(messages)] = [where]
            elif kind == "function_call_output":
                if parsed.call_id not in call_ids:
                    raise ResponsesInputError(f"{where}.call_id", f"No tool call found for function call output with "
                                                                   f"call_id {parsed.call_id[:80]}: {where}.call_id "
                                                                   f"must be the call_id of a function_call item "
                                                                   f"before it in input")
                message = {"role": "tool", "tool_call_id": parsed.call_id,
                           "content": _parts_text(parsed.output, f"{where}.output")}
            else:
                role = "system" if parsed.role == "developer" else parsed.role
                message = {"role": role, "content": _parts_text(parsed.content, f"{where}.content", role)}
            if message["role"] == "assistant" and "".join(reasoning):
                message["reasoning_content"] = "".join(reasoning)
            if message["role"] != "assistant" or reasoning:
                reasoning = []
            messages.append(message)
            sources.messages.append(where)
        fault = unanswered_calls(messages)
        if fault is not None and fault.kind == "twice":
            where = sources.item(fault.message)
            raise ResponsesInputError(f"{where}.call_id", f"{where} is a second function_call_output for call_id "
                                                           f"{str(fault.calls[0][1])[:80]}, which "
                                                           f"{sources.item(fault.before)} already answered (each "
                                                           f"function call has one output)")
        if fault is not None:  # (as OpenAI: "No tool output found for function call ...")
            j, call_id = fault.calls[0]
            item = sources.item(fault.message, j)
            more = f" (nor for {len(fault.calls) - 1} more of its calls)" if len(fault.calls) > 1 else ""
            tail = " in input"
            if fault.before is not None and sources.item(fault.before, 0) == sources.item(fault.before):
                tail = (f", before the function_call {sources.item(fault.before)}, which follows function_call_output "
                        f"items and so starts a new turn of calls (the outputs of the turn before come first)")
            elif fault.before is not None:
                tail = f", before the message {sources.item(fault.before)}"
            raise ResponsesInputError(item, f"no function_call_output for the function call {item} (call_id "
                                            f"{str(call_id)[:80]}){more}: each function_call item needs a "
                                            f"function_call_output item with its call_id after it{tail}")
        return messages, sources

    def chat_request(self) -> "ResponsesChatRequest":
        """The chat completion request this request is served as (its fields typed and checked
        as chat's; a ValidationError names chat's parameters: see :data:`RESPONSES_PARAMS`).

        Raises:
            ResponsesInputError: an input item that cannot be taken (:meth:`input_messages`).
            ValidationError: a field the chat request refuses."""
        messages, self._sources = self._input_messages()
        body: dict[str, Any] = {"model": self.model, "stream": self.stream,
                                "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]}
        for name in ("temperature", "top_p", "parallel_tool_calls", "user") + RESPONSES_EXTENSIONS:
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, ResponsesToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None and (self.tools or self.tool_choice != "auto"):
            body["tool_choice"] = self.tool_choice  # ('auto' without tools: no call, as every Response echoes it)
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort  # (chat maps it: REASONING_EFFORTS)
        chat = ResponsesChatRequest.model_validate(body)
        chat._messages = messages
        if chat.structured_outputs is not None and isinstance(self.structured_outputs, dict):
            self._validated_items.append(("structured_outputs", chat.structured_outputs, self.structured_outputs))
        return chat

    def echo(self, chat: ChatCompletionRequest, defaults: dict | None = None, max_output_tokens: int | None = None) -> dict:
        """The request's settings as a Response object repeats them (``temperature`` and
        ``top_p`` as served: ``defaults`` as in :meth:`ChatCompletionRequest.sampling_kwargs`;
        ``max_output_tokens`` the limit that applied, where given: the request's, else the
        ``generation_config.json``'s ``max_new_tokens`` or the rest of the context)."""
        sampling = chat.sampling_values(defaults)
        choice = self.tool_choice
        if isinstance(choice, ResponsesToolChoice):
            choice = {"type": "function", "name": choice.name}
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        reasoning = self.reasoning or ResponsesReasoning()
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens if max_output_tokens is None else max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary or reasoning.generate_summary},
            "store": False, "background": False,
            "temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "text": {"format": {"type": "text"} if fmt is None else fmt.echo(),
                     **({"verbosity": self.text.verbosity} if self.text is not None and self.text.verbosity else {})},
            "tool_choice": choice or "auto", "tools": [tool.echo() for tool in self.tools or []],
            "truncation": "disabled", "user": self.user,
        }


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat completion a Responses request is served as: its messages as
    :meth:`ResponsesRequest.input_messages` made them (with ``reasoning_content``, which
    chat's own messages do not carry)."""

    _messages: list[dict] = PrivateAttr(default_factory=list)

    def engine_messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]


_MESSAGE_FIELDS = {"content": "content", "tool_call_id": "call_id", "role": "role"}  # (chat message -> input item)


def responses_param(param: str | None, sources: InputSources | None = None) -> str | None:
    """A chat request's parameter as the Responses request names it (:data:`RESPONSES_PARAMS`;
    ``messages.2.content`` as the input item it came from, ``input.1.content``, given
    ``sources``; ``tools.0.function.name`` as ``tools.0.name``)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools":  # (chat's tools.N.function.X: the flat tool's tools.N.X)
        return re.sub(r"^tools\.(\d+)\.function(?=\.|$)", r"tools.\1", param)
    if head == "tool_choice":
        return re.sub(r"^tool_choice\.function(?=\.|$)", "tool_choice", param)
    if head not in RESPONSES_PARAMS:
        return param
    if head == "response_format" and rest.startswith("json_schema"):
        rest = rest[len("json_schema"):].lstrip(".")
    if head == "prompt":
        return "input"
    if head == "messages":
        m = re.fullmatch(r"(\d+)(?:\.(.*))?", rest)
        if sources is None or m is None:
            return "input"
        index, field = int(m.group(1)), m.group(2) or ""
        call = re.fullmatch(r"tool_calls\.(\d+)(?:\.function)?(?:\.(.*))?", field)
        if call is not None:
            item = sources.item(index, int(call.group(1)))
            return item + (f".{call.group(2)}" if call.group(2) and item != "input" else "")
        item = sources.item(index)
        if item in ("input", "instructions"):
            return item
        name = field.split(".", 1)[0]
        if name in _MESSAGE_FIELDS:
            return f"{item}.{_MESSAGE_FIELDS[name]}{field[len(name):]}"
        return item
    return RESPONSES_PARAMS[head] + ("." + rest if rest else "")


_CHAT_NAMES = re.compile(r"\b(response_format(?:\.json_schema(?=\.)| json_schema| json_object)?|max_completion_tokens|max_new_tokens|"
                         r"max_tokens|reasoning_effort)\b|\bthese messages\b|\bmessage (\d+), call (\d+)\b")


def responses_message(message: str, sources: InputSources | None = None, param: str | None = None) -> str:
    """An error message of the chat machinery with chat's parameter names as the Responses API's
    (and ``param``, a chat parameter the message names, as :func:`responses_param` names it)."""
    if param is not None and param in message and (renamed := responses_param(param, sources)) != param:
        message = re.sub(rf"(?<![\w.]){re.escape(param)}(?![\w.])", renamed, message)

    def name(m: re.Match) -> str:
        word = m.group(1)
        if word is None and m.group(2) is not None:  # (the engine's tool-call arguments: message M, call J)
            return sources.item(int(m.group(2)), int(m.group(3))) if sources is not None else "input"
        if word is None:
            return "this input"
        if word == "response_format.json_schema":  # (its schema: the Responses API's text.format.schema)
            return "text.format"
        if word.startswith("response_format"):
            return "text.format" + word[len("response_format"):]
        return "max_output_tokens" if word == "max_new_tokens" else RESPONSES_PARAMS[word]
    message = re.sub(r"\btools\[(\d+)\]\.function\.", r"tools[\1].", message)  # (a Responses tool is flat)
    return _CHAT_NAMES.sub(name, message)


# --- vLLM's /tokenize (the prefill of a completion or chat request) ---


class _TokenizeOptions(BaseModel):
    """vLLM's ``/tokenize`` options beside a completion's ``prompt`` or a chat's ``messages``:
    ``return_token_strs`` (each token's string too). The answer is exactly the tokens that
    completion or chat request prefills, so ``add_special_tokens``, ``add_generation_prompt``
    and ``continue_final_message`` are accepted only at the values that give those
    (:meth:`fixed_option`)."""
    return_token_strs: StrictBool = False
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None

    FIXED: ClassVar[dict[str, bool]] = {}  # option -> the only value the request's own prefill has

    def fixed_option(self) -> tuple[str, str] | None:
        """``(param, message)`` for an option set to what the prefill does not do, else None."""
        for name, value in self.FIXED.items():
            if getattr(self, name) not in (None, value):
                return name, (f"{name} {str(not value).lower()} is not supported: /tokenize returns the tokens this "
                              f"request prefills, which has {name} {str(value).lower()}")
        return None


class TokenizeCompletionRequest(CompletionRequest, _TokenizeOptions):
    """``POST /tokenize`` of a completion's ``prompt`` (one text or token-id list)."""
    samples: ClassVar[bool] = False
    FIXED: ClassVar[dict[str, bool]] = {"add_special_tokens": True, "add_generation_prompt": False,
                                        "continue_final_message": False}
    READS: ClassVar[frozenset[str]] = frozenset({"model", "prompt", "return_token_strs", *FIXED})  # (the rest: ignored)


class TokenizeChatRequest(ChatCompletionRequest, _TokenizeOptions):
    """``POST /tokenize`` of a chat's ``messages`` (with its ``tools``, ``chat_template_kwargs``
    and ``reasoning_effort``), rendered by the chat template as a chat completion is."""
    samples: ClassVar[bool] = False
    FIXED: ClassVar[dict[str, bool]] = {"add_special_tokens": False}  # (the template options are the chat's own)
    READS: ClassVar[frozenset[str]] = frozenset({  # what the prefill's tokens depend on (the rest: ignored)
        "model", "messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort", "chat_template",
        "add_generation_prompt", "continue_final_message", "return_token_strs", *FIXED})


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: ``tokens``, token ids, -> their text."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]
