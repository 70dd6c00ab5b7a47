"""Split a reasoning model's chat reply into its reasoning and its answer as text arrives,
for the server's ``reasoning_content`` (the field DeepSeek's API, vLLM and SGLang return
it in) and ``content``.

Three formats:

* ``think``: the reasoning between ``<think>`` and ``</think>`` (Qwen3, Qwen3.5,
  QwQ, DeepSeek-R1). A reply that starts with ``<think>``, or whose prompt ends with
  an opened ``<think>`` (templates that open it themselves; a ``<think>`` the model
  writes again at the start is dropped too), is reasoning up to
  ``</think>`` (all of it if that never comes: the reply was cut while thinking); the
  text after is the answer. A reply that starts otherwise is all answer.
* ``gemma4``: the same with Gemma 4's thought channel, ``<|channel>thought\n`` ...
  ``<channel|>`` (the channel's name line is not reasoning; an empty channel, which some
  replies write with thinking off, yields no reasoning). With thinking off Gemma 4's template
  ends the prompt with that empty channel, and the reply is all answer; a template that
  forces thinking ends it with the opened channel, and the reply starts inside it.
* ``harmony``: gpt-oss's messages, ``<|channel|>NAME<|message|>BODY<|end|>``, each
  further one after ``<|start|>assistant``: bodies of the ``analysis`` channel are
  reasoning, all others (``final``, ``commentary``) the answer; the markers are dropped
  (OpenAI's harmony response format). Text outside any message is answer.

A parser is fed the reply's text in pieces (:meth:`ReasoningParser.feed`) and returns
what each piece adds to either part, holding back a trailing piece of text that may
still become a marker, until :meth:`ReasoningParser.finish`. The parts do not depend on
where the pieces were cut.
"""

from __future__ import annotations

from ..options import check_choice

PARSERS = ("auto", "none", "think", "gemma4", "harmony")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_CHANNEL = "<|channel>", "<channel|>", "thought\n"
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|return|>", "<|call|>")


class ReasoningParser:
    """Base: all text is the answer."""

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, answer)`` that ``text`` (the next piece of the reply) adds."""
        return "", text

    def finish(self) -> tuple[str, str]:
        """``(reasoning, answer)`` of the text held back, at the end of the reply."""
        return "", ""

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its reasoning (text fed now would be reasoning): a
        reply cut here was cut while thinking; one cut after the reasoning closed was not."""
        return False

    @property
    def answering(self) -> bool:
        """Whether the reply is known to be in its answer (text fed now would be answer).
        Neither this nor :attr:`thinking` while that is not known yet (a ``think`` reply whose
        text so far may still become ``<think>``, a harmony message's header): a streamed piece
        whose text is held back claims neither part then."""
        return True


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in markers):
            return n
    return 0


class ThinkParser(ReasoningParser):
    """The ``think`` format (see the module docstring); a subclass may set other markers
    (``OPEN``, ``CLOSE``) and a channel name line that follows the open marker (``CHANNEL``)."""

    OPEN, CLOSE, CHANNEL = THINK_OPEN, THINK_CLOSE, ""

    def __init__(self, starts_in_reasoning: bool = False):
        # start: is the reply's first text <think>? opened: the template opened it (a
        # second <think> the model writes at the start is dropped too)
        self.state = "opened" if starts_in_reasoning else "start"
        self.buffer = ""
        self.channel = self.CHANNEL  # (the name line still to drop)

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = answer = ""
        if self.state in ("start", "opened"):
            stripped = self.buffer.lstrip()
            if stripped.startswith(self.OPEN):
                self.state, self.buffer = "reasoning", stripped[len(self.OPEN):]
            elif self.OPEN.startswith(stripped):
                return "", ""  # (empty or a prefix of <think>: not known yet)
            else:
                self.state = "reasoning" if self.state == "opened" else "answer"
        if self.state == "reasoning" and self.channel:
            if self.buffer.startswith(self.channel):
                self.buffer, self.channel = self.buffer[len(self.channel):], ""
            elif self.channel.startswith(self.buffer):
                return "", ""  # (a prefix of the name line: not known yet)
            else:
                self.channel = ""
        if self.state == "reasoning":
            end = self.buffer.find(self.CLOSE)
            if end < 0:
                keep = _held(self.buffer, (self.CLOSE,))
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:end], self.buffer[end + len(self.CLOSE):], "answer"
        if self.state == "answer":
            answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" and self.channel and self.channel.startswith(rest):
            return "", ""  # (cut inside the channel's name line)
        return (rest, "") if self.thinking else ("", rest)

    @property
    def thinking(self) -> bool:
        return self.state in ("reasoning", "opened")

    @property
    def answering(self) -> bool:
        return self.state == "answer"


class Gemma4Parser(ThinkParser):
    """The ``gemma4`` format (see the module docstring)."""

    OPEN, CLOSE, CHANNEL = GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_CHANNEL


class HarmonyParser(ReasoningParser):
    """The ``harmony`` format (see the module docstring)."""

    def __init__(self):
        self.state = "body"  # body | header | between
        self.channel = "final"  # text before any message is answer
        self.header = ""
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        parts = {"reasoning": [], "answer": []}
        while True:  # the earliest marker (a "<|" that starts none, e.g. F#'s "f <| x", is text)
            found = [(at, m) for m in HARMONY_MARKERS if (at := self.buffer.find(m)) >= 0]
            if not found:
                keep = _held(self.buffer, HARMONY_MARKERS)
                self._text(self.buffer[:len(self.buffer) - keep], parts)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            at, marker = min(found)
            self._text(self.buffer[:at], parts)
            self.buffer = self.buffer[at + len(marker):]
            self._marker(marker, parts)
        return "".join(parts["reasoning"]), "".join(parts["answer"])

    def _text(self, text: str, parts: dict) -> None:
        if self.state == "header":
            self.header += text
        elif self.state == "body" and text:
            parts["reasoning" if self.channel == "analysis" else "answer"].append(text)
        # (between messages: the role after <|start|>, dropped)

    def _marker(self, marker: str, parts: dict) -> None:
        """Act on ``marker``; ``parts``: what the current piece adds so far (a subclass may add to it)."""
        if marker == "<|constrain|>":
            return  # (part of the header: its text is dropped with it)
        if marker == "<|channel|>":
            self.state, self.header = "header", ""
        elif marker == "<|message|>":
            self.channel = self.header.split()[0] if self.header.split() else "final"
            self.state = "body"
        elif marker == "<|start|>":  # a message's role (dropped), then its header
            self.state, self.header = "between", ""
        else:  # <|end|>, <|return|>, <|call|>: the text after, outside any message, is answer
            self.state, self.channel = "body", "final"

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state != "body" or not rest:
            return "", ""
        return (rest, "") if self.channel == "analysis" else ("", rest)

    @property
    def thinking(self) -> bool:
        return self.state == "body" and self.channel == "analysis"

    @property
    def answering(self) -> bool:
        return self.state == "body" and self.channel != "analysis"


def check_reasoning_parser(value: str, name: str = "reasoning_parser") -> str:
    """One of :data:`PARSERS`.

    Raises:
        OptionError: any other value.
    """
    return check_choice(value, PARSERS, name)


def resolve_parser(choice: str, model_type: str, chat_template: str | dict | None) -> str:
    """The format a server with ``--reasoning-parser choice`` uses: ``auto`` is
    ``harmony`` for gpt-oss, ``gemma4`` for a chat template that mentions ``<|channel>``,
    ``think`` for one that mentions ``<think>`` or ``</think>``, else ``none``.
    ``chat_template``: the tokenizer's (a dict of named templates when it has several: chats
    use its ``default``)."""
    if choice != "auto":
        return choice
    if model_type == "gpt_oss":
        return "harmony"
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    chat_template = chat_template or ""
    if GEMMA4_OPEN in chat_template:
        return "gemma4"
    return "think" if THINK_OPEN in chat_template or THINK_CLOSE in chat_template else "none"


def new_parser(kind: str, prompt_text: str = "") -> ReasoningParser | None:
    """A parser of ``kind`` for a reply to a prompt ending in ``prompt_text`` (None for ``none``)."""
    if kind == "think":
        return ThinkParser(starts_in_reasoning=prompt_text.rstrip().endswith(THINK_OPEN))
    if kind == "gemma4":  # (templates that force thinking end the prompt with the opened channel, name line too)
        tail = prompt_text.rstrip()
        named = tail.endswith(GEMMA4_OPEN + GEMMA4_CHANNEL.rstrip())
        parser = Gemma4Parser(starts_in_reasoning=named or tail.endswith(GEMMA4_OPEN))
        if named:
            parser.channel = ""
        return parser
    if kind == "harmony":
        return HarmonyParser()
    return None


def split(parser: ReasoningParser, text: str) -> tuple[str, str]:
    """``(reasoning, answer)`` of a whole reply."""
    r1, a1 = parser.feed(text)
    r2, a2 = parser.finish()
    return r1 + r2, a1 + a2
