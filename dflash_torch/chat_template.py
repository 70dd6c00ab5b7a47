"""Chat messages checked and rendered through a tokenizer's chat template.

The engine's chat path (:meth:`~dflash_torch.engine.DFlashEngine.encode_prompt`), the
server's chat requests and chat training data all check messages with
:func:`chat_messages` and render them with :func:`render_chat` (transformers'
``apply_chat_template``), so a conversation becomes the same prompt tokens everywhere.
"""

from __future__ import annotations

import inspect
import json
from typing import NamedTuple

from . import options
from .errors import DFlashError, OptionError, shown


# keys under which clients send media beside a message's text (Ollama's "images", a text part's
# "image_url", ...): only text is decoded, so a message or part holding one is refused, never read as text alone
MEDIA_KEYS = ("images", "image", "image_url", "input_image", "audio", "input_audio", "video", "videos",
              "video_url", "file", "files")


def _holds(value) -> bool:
    """Whether ``value`` holds something: not None, nor an empty string, list, tuple or dict
    (told by type and length: any other value, e.g. False, 0 or an array, holds something)."""
    return value is not None and not (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)


def media_keys(item: dict, role=None) -> list[str]:
    """The :data:`MEDIA_KEYS` that ``item`` (a chat message of ``role``, or one of its content
    parts: ``role`` None) holds with a value (not None, nor an empty string, list, tuple or
    dict: :func:`_holds`); an assistant message's ``audio`` (OpenAI's reply, sent back as it
    came) is not one beside its text (content, tool calls or a refusal), but is where the
    message has nothing else."""
    spoken = role == "assistant" and (item.get("content") is not None or _holds(item.get("tool_calls"))
                                      or item.get("refusal") is not None)
    return [k for k in MEDIA_KEYS if _holds(item.get(k)) and not (k == "audio" and spoken)]


def render_chat(tokenizer, messages: list[dict], template_kwargs: dict) -> str:
    """``tokenizer``'s chat template applied to ``messages`` with ``template_kwargs``: the
    extra template variables and ``apply_chat_template``'s own ``add_generation_prompt``
    (default true) and ``continue_final_message`` options. The engine's chat path
    (:meth:`~dflash_torch.engine.DFlashEngine.encode_prompt`) and chat training data render with it.

    Tool calls' ``arguments`` reach the template as mappings (what :func:`chat_messages`
    makes of them); a template that fails on that (a TypeError or its own error: DeepSeek
    V3's, V3.1's and R1's join the arguments to a string) renders them again as JSON text:
    the text each call was sent as, else its compact JSON (see :func:`_render`).

    Raises:
        DFlashError: the template refuses the messages (its ``raise_exception``, e.g.
            roles out of order) or cannot be rendered at all (a broken template), or
            the messages, tools or variables are nested too deeply to render. A
            TypeError names the tools or ``chat_template_kwargs`` (an
            :class:`OptionError` with those names) only when the messages render without
            them; otherwise it names the messages.
    """
    import jinja2

    template_kwargs = {"add_generation_prompt": True, **template_kwargs}
    try:
        return _render(tokenizer, messages, template_kwargs)
    except (jinja2.TemplateSyntaxError, jinja2.TemplateAssertionError) as exc:
        raise DFlashError(f"the model's chat template cannot be rendered: {' '.join(str(exc).split())}") from None
    except jinja2.TemplateError as exc:
        raise DFlashError(f"the chat template refuses these messages: {' '.join(str(exc).split())}") from None
    except TypeError as exc:  # e.g. a template function (raise_exception) shadowed by a chat_template_kwargs value
        blamed = _blamed_options(tokenizer, messages, template_kwargs)
        what = " or ".join(f"these {n}" for n in blamed) or "these messages"
        message = f"the chat template cannot render {what}: {' '.join(str(exc).split())}"
        raise (OptionError(message, *blamed) if blamed else DFlashError(message)) from None
    except ValueError as exc:  # (transformers: continue_final_message with a last message the template drops)
        if not template_kwargs.get("continue_final_message"):
            raise
        raise OptionError(f"continue_final_message: the chat template does not render the last message's text "
                          f"as sent, so the prompt cannot end inside it ({' '.join(str(exc).split())})",
                          "continue_final_message") from None
    except RecursionError:  # (jinja and its tojson recurse once per level of nesting)
        raise DFlashError("the chat template cannot render these messages: their content, tool calls, tools or "
                          "chat_template_kwargs are nested too deeply") from None


def _render(tokenizer, messages: list[dict], template_kwargs: dict) -> str:
    """The template applied to ``messages`` with each tool call's ``arguments`` a mapping
    (the templates of gpt-oss, Qwen3-Coder, ... iterate it or write it with ``tojson``); if
    that fails (a TypeError or a template error, not a broken template) and some message
    has tool calls, applied again with each call's arguments as JSON text (DeepSeek's
    templates write ``'<｜tool▁sep｜>' + arguments``): the text the call was sent as, as
    the client's own rendering of its messages has it, else its compact JSON. When both
    fail, the first failure is raised."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    except (TypeError, jinja2.TemplateError) as exc:
        if isinstance(exc, (jinja2.TemplateSyntaxError, jinja2.TemplateAssertionError)) or \
                not any(m.get("tool_calls") for m in messages):
            raise
        try:
            return tokenizer.apply_chat_template(_with_text_arguments(messages), tokenize=False, **template_kwargs)
        except Exception:
            raise exc from None


def _with_text_arguments(messages: list[dict]) -> list[dict]:
    """``messages`` with each tool call's mapping ``arguments`` as JSON text: the text it was
    sent as (:class:`_Arguments`), else compact JSON (copies)."""
    def text(arguments):
        if isinstance(arguments, _Arguments):
            return arguments.text
        return json.dumps(arguments, ensure_ascii=False, separators=(",", ":")) if isinstance(arguments, dict) \
            else arguments
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": text(c["function"].get("arguments"))}}
                                 if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                                 for c in m["tool_calls"]]} if isinstance(m.get("tool_calls"), list) else m
            for m in messages]


def _blamed_options(tokenizer, messages: list[dict], template_kwargs: dict) -> list[str]:
    """What a TypeError of the template is provably due to: ``chat_template_kwargs`` and
    ``tools`` given in ``template_kwargs`` whose leaving out lets the messages render (both,
    when only leaving out both does); none (the messages) when the messages do not render
    without them either."""
    own = {"add_generation_prompt", "continue_final_message"}
    given = {"chat_template_kwargs": set(template_kwargs) - own - {"tools"},
             "tools": {"tools"} & set(template_kwargs)}
    given = {name: keys for name, keys in given.items() if keys}

    def renders(left_out: set) -> bool:
        try:
            _render(tokenizer, messages, {k: v for k, v in template_kwargs.items() if k not in left_out})
        except Exception:
            return False
        return True

    if not given or not renders(set().union(*given.values())):
        return []
    return [name for name, keys in given.items() if renders(keys)] or list(given)


def reserved_template_variables(tokenizer) -> list[str]:
    """The named parameters of ``tokenizer.apply_chat_template``, and ``messages``: the names
    no extra chat template variable may take (see :meth:`~dflash_torch.engine.DFlashEngine.reserved_template_variables`)."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)] + ["messages"]


def _fault(m: dict) -> str:
    """What is wrong with chat message ``m``, whose role is not a string or whose content is
    not one it may have: "has no role", "has a null content", ..."""
    role, content = m.get("role"), m.get("content")
    if role is None:
        return "has no role"
    if not isinstance(role, str):
        return f"has a role of type {type(role).__name__}, not a string"
    if "content" not in m:
        return "has no content"
    if content is None:
        return "has a null content"
    return f"has a content of type {type(content).__name__}, not a string or a list of text parts"


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # (OpenAI's message roles)


def _not_messages_hint(messages: list | tuple) -> str:
    """What :func:`chat_messages`' error about a prompt list that is not all chat messages
    adds (``; got ...``), by what the list holds: lists (or 1-D tensors, arrays) of ids, a
    tokenizer's batch (its row, or its rows to ``generate_batch``); (role, content) pairs (dicts are the messages: how
    to make them); lists of messages, conversations (``generate`` takes one,
    ``generate_batch`` a list); strings, texts (``generate_batch`` takes several); ``""``
    for anything else."""
    kind = "tuple" if isinstance(messages, tuple) else "list"
    n = len(messages)

    def pair(m) -> bool:
        return isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(x, str) for x in m)

    if n == 2 and all(isinstance(m, str) for m in messages) and messages[0] in CHAT_ROLES:  # (one message as a pair)
        return (f"; got a {kind} of 2 strings, {messages[0]!r} and a text: a chat message is a dict, not a (role, "
                f"content) pair; pass [{{'role': {messages[0]!r}, 'content': text}}]")
    if n and all(isinstance(m, str) for m in messages):  # (several texts given as one prompt)
        return f"; got a {kind} of {n} string{'s' if n != 1 else ''} (" + (
            "one text prompt: pass the string itself)" if n == 1 else f"{n} text prompts: generate_batch takes them)")
    others = [m for m in messages if not isinstance(m, dict)]
    if all(map(pair, others)):  # ([("user", "hi"), ...], some messages dicts perhaps)
        got = "a (role, content) pair" if len(others) == 1 else f"{len(others)} (role, content) pairs"
        return f"; got {got}: each chat message is a dict, [{{'role': role, 'content': content}} for role, content in pairs]"
    lists = all(isinstance(m, (list, tuple)) for m in messages)
    # (1-D tensors or arrays: the rows of one, list(input_ids) of a tokenizer's return_tensors="pt" / "np")
    if not n or not (lists or all(getattr(m, "ndim", None) == 1 for m in messages)):
        return ""
    if lists and all(isinstance(x, dict) for m in messages for x in m) and any(messages):  # (conversations)
        return (f"; got a {kind} of {n} list{'s' if n != 1 else ''} of chat messages: generate takes one conversation "
                "(a list of message dicts), generate_batch a list of them")
    if all(hasattr(x, "__index__") and not isinstance(x, (bool, str)) for m in messages for x in m):  # (a tokenizer's batch)
        row = "list" if lists else next((w for t, w in (("Tensor", "1-D tensor"), ("ndarray", "1-D array"))
                                         if all(type(m).__name__ == t for m in messages)), "1-D sequence")
        return (f"; got a {kind} of one {row} (a batch of one): pass its row, ids[0]" if n == 1
                else f"; got a {kind} of {n} {row}s ({n} prompts: generate_batch takes them)")
    if not lists:
        return ""
    if all(isinstance(x, str) for m in messages for x in m):
        return f"; got a {kind} of lists of strings: each chat message is a dict {{'role': str, 'content': str}}"
    return ""


class CallAnswerFault(NamedTuple):
    """A fault of :func:`unanswered_calls`: ``kind`` ``"unanswered"``, the tool calls of
    assistant message ``message`` that ``calls`` (``[(index in its tool_calls, id)]``) are
    not answered before message ``before`` (None: the messages end there); ``"twice"``, tool
    message ``message`` answers the call ``calls[0]`` that message ``before`` answered
    (``by_position``: a tool message without a ``tool_call_id``, taken to answer the first
    call not yet answered)."""

    kind: str
    message: int
    calls: list[tuple[int, object]]
    before: int | None
    by_position: bool = False


def unanswered_calls(messages: list[dict], continue_final_message: bool = False) -> CallAnswerFault | None:
    """The first fault of the answers to ``messages``' tool calls, as OpenAI refuses them:
    each call with an ``id`` of an assistant message is answered by a ``tool`` message whose
    ``tool_call_id`` is that id, among the tool messages right after the assistant message
    (before the next message of another role, or the end of the messages), and once; a tool
    message without a ``tool_call_id`` (as Hugging Face's examples write them) answers the
    first call not yet answered. Calls without an ``id`` are not checked, nor tool messages
    whose id no call has (:func:`chat_messages` and the server refuse those, unless a call
    without an id came before). The calls of a last assistant message followed by nothing are
    taken with ``continue_final_message`` (the prompt ends inside that message, which the
    reply continues). Ids are compared by value (``1`` answers ``1``); an id an earlier
    message's call had again (clients that number each turn's calls ``call_0``, ...) is
    a new call's. ``messages``: dicts with ``role`` and, where they have them,
    ``tool_calls`` (dicts with ``id``) and ``tool_call_id``. None when there is none."""
    def key(value) -> str:
        return json.dumps(value, sort_keys=True, default=repr)

    opened, pending = None, []  # (the assistant message whose calls the tool messages now answer; its unanswered calls)
    answered: dict[str, int] = {}  # an answered call's id -> the tool message that answered it
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            given = m.get("tool_call_id")
            at = next((n for n, (_, v) in enumerate(pending) if given is not None and key(v) == key(given)),
                      0 if given is None and pending else None)
            if at is not None:
                answered[key(pending[at][1])] = i
                del pending[at]
            elif given is not None and key(given) in answered:
                before = answered[key(given)]
                return CallAnswerFault("twice", i, [(0, given)], before, messages[before].get("tool_call_id") is None)
            continue
        if pending:
            return CallAnswerFault("unanswered", opened, [(j, v) for j, v in pending], i)
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        opened, pending = i, [(j, c["id"]) for j, c in enumerate(calls if isinstance(calls, list) else ())
                              if isinstance(c, dict) and c.get("id") is not None]
        for _, v in pending:
            answered.pop(key(v), None)  # (an id again: a new call's)
    if pending and not (continue_final_message and opened == len(messages) - 1):
        return CallAnswerFault("unanswered", opened, [(j, v) for j, v in pending], None)
    return None


def quoted_ids(calls: list[tuple[int, object]]) -> str:
    """The ids of a :class:`CallAnswerFault`'s ``calls``, quoted as an error shows them (the
    first 10, each cut to 80 characters)."""
    return ", ".join(shown(v[:80] if isinstance(v, str) else v) for _, v in calls[:10]) + \
        (f" and {len(calls) - 10} more" if len(calls) > 10 else "")


def _answer_fault_words(fault: CallAnswerFault) -> str:
    """:func:`chat_messages`' message of a :class:`CallAnswerFault`."""
    if fault.kind == "twice" and fault.by_position:  # (trial-299 f: "already answered" by a message without an id)
        return (f"chat message {fault.message}: tool_call_id {quoted_ids(fault.calls)} answers a tool call that "
                f"chat message {fault.before}, a tool message without a tool_call_id, was taken to answer (it answers "
                f"the first call not yet answered; each call is answered once)")
    if fault.kind == "twice":
        return (f"chat message {fault.message}: tool_call_id {quoted_ids(fault.calls)} answers a tool call that "
                f"chat message {fault.before} already answered (each call is answered once)")
    where = f"before chat message {fault.before}" if fault.before is not None else \
        "before the messages end (to continue that assistant message instead, pass continue_final_message=True " \
        "with add_generation_prompt=False)"
    return (f"chat message {fault.message}: an assistant message's tool calls must each be answered by a tool "
            f"message (its tool_call_id the call's id) right after it, before a message of another role; not "
            f"answered {where}: {quoted_ids(fault.calls)}")


def chat_messages(messages: list | tuple, check_tool_call_ids: bool = True,
                  continue_final_message: bool = False) -> list[dict]:
    """Checked chat messages (see :meth:`~dflash_torch.engine.DFlashEngine.encode_prompt`), with each tool call's
    ``arguments`` JSON string parsed into a dict, a ``content`` None or absent (beside
    ``tool_calls``) as ``""``, an assistant's ``refusal`` (OpenAI's reply, with content
    None) joined to its content by a newline, and a ``developer`` message as ``system``
    (OpenAI's newer name for it, which chat templates do not know: Qwen3's dropped it), as
    the server sends them (copies; the caller's are not changed).

    Raises:
        DFlashError: a list that does not hold dicts (the message says what it holds instead:
            :func:`_not_messages_hint`), a message that is not a dict with a string ``role`` and a string
            ``content`` (named by its index, with what is wrong: "chat message 1 has no role")
            (or a list of text parts; None allowed with ``tool_calls`` or a
            ``refusal``), a ``refusal`` that is not a string of an assistant message, ``tool_calls``
            (not empty) of a message other than an assistant's, a ``tool_call_id`` of one other than
            a tool message, or one that is not the ``id`` of a tool call of an earlier assistant
            message (as the server refuses it; a tool message without one, as Hugging Face's
            examples write them, or after a call without an ``id``, is taken; not checked with
            ``check_tool_call_ids`` false: training data, whose rendering the ids do not change),
            ``tool_calls`` that are not a
            list of ``{"function": {"name": str, "arguments": ...}}``, ``arguments`` that
            are not a JSON object (a dict or its JSON text; ``""`` and None are ``{}``), or
            (with ``check_tool_call_ids``) an assistant message's call with an ``id`` that no
            tool message right after it answers, or a call answered twice, as OpenAI and the
            server refuse them (:func:`unanswered_calls`; a last assistant message's calls are
            taken with ``continue_final_message``, the prompt ending inside that message).
    """
    if not all(isinstance(m, dict) for m in messages):
        raise DFlashError("a prompt list must hold token ids (ints) or chat messages ({'role': str, 'content': str})"
                          + _not_messages_hint(messages))
    out = []
    ids: set = set()  # (the ids of earlier tool calls; a call without one lets any tool_call_id answer it)
    anonymous = False
    for i, m in enumerate(messages):
        if media := media_keys(m, m.get("role")):
            raise DFlashError(f"chat message {i} holds {media[0]!r}: only text is supported (the model is decoded as "
                              "text), so a message with images, audio, video or files is refused")
        if isinstance(m.get("content"), list):
            m = {**m, "content": _parts_text(m["content"], m.get("role"), i)}
        calls = m.get("tool_calls")
        refusal = m.get("refusal")
        if refusal is not None and m.get("role") != "assistant":  # (as the server refuses it)
            raise DFlashError(f"chat message {i} has a refusal, which only an assistant message may hold")
        if _holds(calls) and m.get("role") != "assistant":  # (as the server refuses them)
            raise DFlashError(f"chat message {i} has tool_calls, which only an assistant message may hold")
        answered = m.get("tool_call_id")
        if answered is not None and m.get("role") != "tool":
            raise DFlashError(f"chat message {i} has a tool_call_id, which only a tool message may hold")
        if check_tool_call_ids and answered is not None and not anonymous and \
                json.dumps(answered, sort_keys=True, default=repr) not in ids:  # (as the server refuses it)
            raise DFlashError(f"chat message {i}: tool_call_id {shown(answered[:80] if isinstance(answered, str) else answered)} is not the id of a tool call of an "
                              "earlier assistant message (a tool message answers one)")
        if refusal is not None and not isinstance(refusal, str):
            raise DFlashError(f"chat message {i}: refusal must be a string, got {type(refusal).__name__}")
        content = m.get("content")
        content_ok = isinstance(content, str) or ((_holds(calls) or refusal is not None) and content is None)
        if not isinstance(m.get("role"), str) or not content_ok:  # (each fault named, as a content part's is: trial-272)
            raise DFlashError(f"chat message {i} {_fault(m)}: each message is {{'role': str, 'content': str}} (content "
                              "may be null or left out with tool_calls or an assistant's refusal)")
        if refusal is not None:  # (its text follows the content's, as the server reads it: see ChatMessage.text)
            m = {k: v for k, v in m.items() if k != "refusal"}
            m["content"] = "\n".join(t for t in (m.get("content"), refusal) if t)
        if m.get("content") is None:  # (with tool_calls: "", as the server sends it, see ChatMessage.text)
            m = {**m, "content": ""}
        if m["role"] == "developer":  # (as the server reads it: ChatMessage.engine_message)
            m = {**m, "role": "system"}
        if calls is None:
            out.append(m)
            continue
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls):
            raise DFlashError(f"chat messages need tool_calls as a list of {{'type': 'function', 'function': "
                              f"{{'name': str, 'arguments': str}}}} (message {i})")
        for c in calls:
            if c.get("id") is None:
                anonymous = True
            else:  # (an id of another type, e.g. 1, is answered by the same value: the template renders it so)
                ids.add(json.dumps(c["id"], sort_keys=True, default=repr))
        out.append({**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _call_arguments(
            c["function"].get("arguments", {}), i, j)}} for j, c in enumerate(calls)]})
    if check_tool_call_ids and (fault := unanswered_calls(out, continue_final_message)) is not None:
        raise DFlashError(_answer_fault_words(fault))
    return out


def _parts_text(parts: list, role, message: int) -> str:
    """A message's ``content`` given as OpenAI's list of parts: the texts of its text parts
    (``{"type": "text", "text": str}``; in an assistant message also ``{"type": "refusal",
    "refusal": str}``) joined by newlines, as the server (and vLLM) joins them.

    Raises:
        DFlashError: a part of another kind (an image, ...) or without its string."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        field = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
        if field is not None and (media := media_keys(part)):
            raise DFlashError(f"chat message {message}: content part {j} holds {media[0]!r}: only text is supported")
        if field is None or not isinstance(part.get(field), str):
            raise DFlashError(f"chat message {message}: content part {j} must be {{'type': 'text', 'text': str}} (or, in "
                              f"an assistant message, {{'type': 'refusal', 'refusal': str}}); got {str(part)[:80]}")
        texts.append(part[field])
    return "\n".join(texts)


class _Arguments(dict):
    """A tool call's arguments parsed from JSON text, with ``text``, the text as sent (what a
    template that writes the arguments as text renders: :func:`_render`)."""

    def __init__(self, value: dict, text: str):
        super().__init__(value)
        self.text = text


def _call_arguments(arguments, message: int, call: int) -> dict:
    """A tool call's arguments as a dict: a dict, or a JSON object's text (an
    :class:`_Arguments` that keeps it); ``""`` and None are ``{}`` (a call without
    arguments, as vLLM takes them). Strict JSON: NaN and Infinity are refused (as is a
    dict holding a float NaN or infinity); a number beyond a float's range in the text is
    taken."""
    if arguments is None or arguments == "":
        return {}
    text = None
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = options.strict_json(arguments)
        except ValueError as exc:
            raise DFlashError(f"tool call arguments must be a JSON object: message {message}, call {call}: "
                              f"not valid JSON ({exc})") from None
        except RecursionError:
            raise DFlashError(f"tool call arguments must be a JSON object: message {message}, call {call}: "
                              "nested too deeply") from None
    if not isinstance(arguments, dict):
        raise DFlashError(f"tool call arguments must be a JSON object: message {message}, call {call}: "
                          f"got {options.json_type(arguments)}")
    if text is None and options.non_finite(arguments):  # (text: 1e400 is valid JSON, NaN was refused above)
        raise DFlashError(f"tool call arguments must be a JSON object: message {message}, call {call}: "
                          "holds NaN or infinity, which JSON has not")
    return _Arguments(arguments, text) if text is not None else arguments
