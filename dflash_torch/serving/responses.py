"""The Response objects and stream events of ``POST /v1/responses`` (OpenAI's Responses
API), built from a chat reply as :mod:`.tools` splits it: reasoning, content, tool calls.

:class:`ResponseBuilder` takes the reply piece by piece and returns the stream's events
(dicts with ``type`` and ``sequence_number``); the non-streamed response is the final
response of the same events, so both are the same output. The output items follow the
reply: a ``reasoning`` item (``content``: one ``reasoning_text``; ``summary`` empty: the
reasoning is given whole, not summarised) while the reply reasons, a ``message`` item
(one ``output_text``) while it answers, a ``function_call`` item per tool call (its
``call_id`` the call's id, its ``arguments`` the JSON text). A reply cut by the token limit
is ``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``; the item open then
too, but for a reasoning item whose reasoning had closed). A reply that ended inside its reasoning
before that wrote any text has an (empty) reasoning item; one with no reasoning, text or call
still has its (empty) message.

Stream events, as OpenAI sends them: ``response.created`` and ``response.in_progress``
(the response so far: no output), then per item ``response.output_item.added``, for a
message or reasoning ``response.content_part.added``, its ``response.output_text.delta``
/ ``response.reasoning_text.delta`` events (one per piece of text), the matching ``.done``,
``response.content_part.done``; for a call ``response.function_call_arguments.delta`` (the
arguments whole: the parser finds a call once it is complete) and ``.done``; then
``response.output_item.done``; last ``response.completed`` or ``response.incomplete``
with the whole response.
"""

from __future__ import annotations

import re
import time
import uuid

from .tools import json_text


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_MARKER_EDGES = re.compile(r"(?=<)|(?<=>)")


def marker_pieces(text: str) -> list[str]:
    """``text`` cut before every ``<`` and after every ``>``, so that no piece holds more than
    one edge of a tool-call or reasoning marker (``<tool_call>``, ``</think>``, ...): fed to a
    reply parser piece by piece, what it returns for one piece (text, then the calls it
    completed) is in the order the reply wrote them. A whole reply (a non-streamed one, or a
    round's tokens) may hold text after a call."""
    return [piece for piece in _MARKER_EDGES.split(text) if piece]


def sse_event(event: dict) -> str:
    """One server-sent event of the Responses stream (``event:`` its type, ``data:`` the JSON)."""
    return f"event: {event['type']}\ndata: {json_text(event)}\n\n"


class ResponseBuilder:
    """A Response and its stream events, from the pieces of one chat reply.

    Args:
        rid: the response's id (``resp_...``).
        model: the model id.
        echo: the request's settings the response repeats (:meth:`ResponsesRequest.echo`).
        created_at: when the request came (Unix seconds; default: now).
    """

    def __init__(self, rid: str, model: str, echo: dict, created_at: int | None = None):
        self.rid, self.model, self.echo = rid, model, echo
        self.created_at = int(time.time()) if created_at is None else created_at
        self.items: list[dict] = []  # the output items, as they stand
        self.open: int | None = None  # the index of the reasoning or message item text goes to, if any
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete_details = None
        self.usage = None
        self.completed_at = None
        self.extra: dict = {}

    # ---- the response -------------------------------------------------------------------
    def response(self) -> dict:
        """The Response object as it stands (with every item as it stands)."""
        body = {"id": self.rid, "object": "response", "created_at": self.created_at, "status": self.status,
                "completed_at": self.completed_at, "error": None, "incomplete_details": self.incomplete_details,
                "model": self.model, "output": [_copy(item) for item in self.items], "usage": self.usage, **self.echo}
        body.update(self.extra)
        return body

    @property
    def output_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])

    def _event(self, type: str, **fields) -> dict:
        event = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def error(self, message: str, type: str, param: str | None, code: str | None) -> dict:
        """The stream's ``error`` event (the response ends there)."""
        return self._event("error", code=code or type, message=message, param=param)

    # ---- the reply, piece by piece --------------------------------------------------------
    def feed(self, reasoning: str = "", text: str = "", calls=()) -> list[dict]:
        """The events of the reply's next piece: ``reasoning`` text, answer ``text`` and the
        tool calls it completed (:class:`~.tools.ToolCall`, in that order)."""
        events = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if text:
            events += self._text("message", text)
        for call in calls:
            events += self._close()
            index = len(self.items)
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name, "arguments": "",
                    "status": "in_progress"}
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=index, item=_copy(item)))
            item["arguments"] = call.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                      delta=call.arguments))
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      arguments=call.arguments))
            item["status"] = "completed"
            events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        opening = self.open is None or self.items[self.open]["type"] != kind
        if opening and kind == "message" and self.items and self.items[-1]["type"] == "function_call":
            text = text.lstrip()  # (the whitespace that parts chat content around a call: a new item needs none)
            if not text:
                return events
        if opening:
            events += self._close()
            events += self._open(kind)
        index = self.open
        item = self.items[index]
        item["content"][0]["text"] += text
        if kind == "message":
            events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=text))
        return events

    def _open(self, kind: str) -> list[dict]:
        index = len(self.items)
        if kind == "message":
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = index
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part)))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        """The done events of the open reasoning or message item, if any."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.items[index]
        part = item["content"][0]
        if item["type"] == "message":
            done = self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"])
        item["status"] = status
        return [done, self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                  part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def finish(self, finish_reason: str, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
               reasoning_tokens: int = 0, extra: dict | None = None, thinking: bool = False) -> list[dict]:
        """The last events: the open item closed, ``response.completed`` (or, cut by the token
        limit, ``finish_reason`` ``length``: ``response.incomplete``) with the usage.
        ``thinking``: the reply was still inside its reasoning (a reasoning item open when the
        reply was cut is ``incomplete`` only then: one whose reasoning closed is complete; a
        reasoning that wrote no text yet is an empty reasoning item, as chat's content null)."""
        cut = finish_reason == "length"
        events = []
        open_reasoning = self.open is not None and self.items[self.open]["type"] == "reasoning"
        if thinking and not open_reasoning:  # (ended in a reasoning before its text: cut or stopped there)
            events += self._close() + self._open("reasoning")
        elif not self.items:  # (nothing at all: the empty message, as chat's content "")
            events += self._open("message")
        open_reasoning = self.open is not None and self.items[self.open]["type"] == "reasoning"
        events += self._close("incomplete" if cut and (thinking or not open_reasoning) else "completed")
        self.status = "incomplete" if cut else "completed"
        self.incomplete_details = {"reason": "max_output_tokens"} if cut else None
        self.completed_at = int(time.time())
        self.usage = {"input_tokens": input_tokens,
                      "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
                      "total_tokens": input_tokens + output_tokens}
        self.extra = dict(extra or {})
        events.append(self._event("response.incomplete" if cut else "response.completed", response=self.response()))
        return events


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
