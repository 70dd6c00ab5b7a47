"""Stopping, decided on committed tokens one at a time.

A decoding round commits several tokens at once. :class:`Stopper` walks them in order
and decides exactly as one-token-at-a-time decoding would, whatever the round
boundaries:

* a stop token id ends generation at that token (kept in the token ids; its text is
  not part of the output text);
* otherwise, after each token, the text it completed is checked for stop strings: the
  first token after which a stop string occurs in the text ends generation, and the
  text is cut at the start of that occurrence. Only an occurrence that ends in the
  token's own text can be new; if the token completes several (of the same or of
  different stop strings), the cut is at the earliest start among them (or, keeping the
  stop string, vLLM's ``include_stop_str_in_output``, at the end of that occurrence);
* otherwise generation ends after ``max_new_tokens`` tokens (a stop string completed
  by that last token still counts as a stop).

With ``min_tokens`` (vLLM's semantics), stop strings are looked for only from the token
after the first ``min_tokens``: an occurrence completed within them does not count (one
completed later may start in their text). The stop tokens cannot occur there: the
decoder masks them (``SamplingParams.min_tokens``).

The text is what the output adds to a few of the prompt's last tokens
(:meth:`Stopper.start`): ``decode(context + output)[len(decode(context)):]``, as vLLM and
transformers' pipelines give it (a SentencePiece tokenizer's first word keeps its
space). It is decoded incrementally (:class:`IncrementalText`), so a round costs
decodes of a few tokens, not of the whole output. Stop strings are matched against
complete text: a token that ends inside a multi-byte character adds no text until a
later token completes it (trailing U+FFFD characters count when a character follows
them, or at the end of generation), and a byte-fallback tokenizer's byte tokens add
their text when a token that is not one follows them (or at the end). Streamed text
never contains characters that a later token could still turn into the start of a
stop string (:func:`partial_stop`), and the output text never contains a stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping
from typing import Callable, Collection, Sequence


def find_stop(text: str, new_from: int, stops: Sequence[str], include: bool = False) -> int | None:
    """Where to cut ``text`` because ``text[new_from:]`` completed a stop string.

    Args:
        text: text that holds every character a new occurrence can start at (at least
            the last ``len(s) - 1`` characters before ``new_from`` for each stop string s).
        new_from: index in ``text`` where the newly produced characters start.
        stops: non-empty stop strings.
        include: cut after the occurrence instead (vLLM's ``include_stop_str_in_output``).

    Returns:
        The earliest start (index in ``text``) among the occurrences of any stop string
        that end after ``new_from`` (with ``include``: the end of that occurrence; of the
        stop strings starting there, the longest), or None when there is none.
    """
    found = [(i, -len(s)) for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    if not found:
        return None
    start, minus_length = min(found)
    return start - minus_length if include else start


def partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string
    (0 if none): the characters that more text could turn into the start of one."""
    n, longest = len(text), 0
    for s in stops:
        # candidate starts i give suffixes longer than ``longest`` and shorter than s
        i = text.find(s[0], max(0, n - len(s) + 1), n - longest)
        while i >= 0:
            if s.startswith(text[i:]):
                longest = n - i  # the first candidate is the longest suffix for this s
                break
            i = text.find(s[0], i + 1, n - longest)
    return longest


CONTEXT_TOKENS = 4  # prompt tokens decoded before the output (Stopper.start): a word-start marker
# depends on the token before it, so a few are plenty (vLLM's detokenizer starts from 4 too)


class IncrementalText:
    """The text of a growing token sequence after some context tokens, decoded over a short
    window of tokens.

    The text of tokens ``t`` after the context ``c`` (a few tokens of the prompt, see
    :meth:`start`) is ``decode(c + t)[len(decode(c)):]``: what they add to the context's
    text, as vLLM's detokenizer and transformers' pipelines (``return_full_text=False``)
    give it, so a SentencePiece word-start marker on the first token is a space (decoded
    alone it would be stripped).

    Each :meth:`push` decodes the tokens since the last clean character boundary plus,
    as context, the tokens of the text piece before them (for tokenizers whose decoding
    of a token depends on the one before, such as a SentencePiece word-start marker),
    and returns the text the new token added. The text is complete up to its trailing
    U+FFFD characters: those may be an incomplete multi-byte character that a later
    token completes, so they are returned only once a later character follows them, or
    by :meth:`flush`. UTF-8 is decoded left to right, so everything before them is final.
    A run of ``held`` tokens (a byte-fallback tokenizer's byte tokens ``<0xHH>``, whose
    run decodes as one: as UTF-8 if it is valid, else one U+FFFD per byte) is returned
    once a token outside it ends the run, or by :meth:`flush`: until then a later byte
    could still turn the whole run, valid so far, into U+FFFD characters.
    The pieces, plus :meth:`flush` at the end, concatenate to
    ``decode(context + all tokens)[len(decode(context)):]`` (``decode(all tokens)``
    without context), and no piece is changed by a later token (for decoders whose text
    of a token depends on no more than the token before it, its byte run and the UTF-8
    character it is part of: byte-level BPE, Metaspace, SentencePiece with byte fallback).
    Cost: two decodes of a few tokens per token (none for a held token).

    Args:
        decode: token ids -> text (the engine's ``decode``).
        held: the ids of byte tokens (empty: none), or a mapping of them to their byte values
            (the engine's :attr:`~dflash_torch.engine.DFlashEngine.byte_token_values`), by which a
            run's characters are counted exactly (without it, by decoding the run alone).
    """

    def __init__(self, decode: Callable[[list[int]], str], held: Collection[int] = frozenset()):
        self.decode, self.held = decode, held
        self.window: list[int] = []  # context tokens, then the tokens since the last clean boundary
        self.context = 0  # leading tokens of the window that are context
        self.returned = 0  # characters of decode(window) already returned (the context's included)
        self.open_run = 0  # the context's trailing held tokens while the run they end may go on (start)

    def start(self, context: Sequence[int]) -> None:
        """Decode the tokens to come after ``context`` (before the first :meth:`push`)."""
        self.window, self.context, self.open_run = list(context), len(context), 0
        self.returned = len(self.decode(self.window)) if self.window else 0
        # a context that ends in a run of held tokens, which the output may go on: the
        # characters of the context's bytes are known once the run ends (_settle)
        while self.open_run < len(self.window) and self.window[-1 - self.open_run] in self.held:
            self.open_run += 1

    def _settle(self) -> None:
        """Count the characters of the context's trailing run in ``returned`` once the run has
        ended (or the output ends): a run decodes as one, as UTF-8 if it is valid, else one
        U+FFFD per byte, so the context's bytes may end inside a character the output's bytes
        complete (that character is the context's) or turn invalid with them."""
        self.returned, self.open_run = self._context_chars(), 0

    def _run_start(self, end: int) -> int:
        """Where the run of held tokens that ends at window position ``end`` starts."""
        start = end
        while start > 0 and self.window[start - 1] in self.held:
            start -= 1
        return start

    def _run_text(self, start: int, end: int) -> tuple[str, bool]:
        """The text of the window's run ``start:end`` (from the byte values where ``held``
        maps them, else as the window decodes it) and whether it is valid UTF-8."""
        if not isinstance(self.held, Mapping):
            text = self.decode(self.window[:end])[len(self.decode(self.window[:start])) if start else 0:]
            return text, "\ufffd" not in text
        data = bytes(self.held[t] for t in self.window[start:end])
        try:
            return data.decode("utf-8"), True
        except UnicodeDecodeError:
            return "\ufffd" * len(data), False

    def _context_chars(self) -> int:
        """What ``returned`` is while the context's trailing run of ``open_run`` tokens goes
        on into the window's held tokens after it (see :meth:`_settle`)."""
        k = self.open_run
        start = self.context - k
        end = start + k
        while end < len(self.window) and self.window[end] in self.held:
            end += 1
        prefix = len(self.decode(self.window[:start])) if start else 0
        run, valid = self._run_text(start, end)
        owned = k
        if valid:  # the characters that start in the context's k bytes
            owned, at = 0, 0
            for char in run:
                if at >= k:
                    break
                owned, at = owned + 1, at + len(char.encode("utf-8"))
        dropped = len(run) - (len(self.decode(self.window[:end])) - prefix)  # (a stripped leading space)
        return prefix + max(0, owned - max(0, dropped))

    def push(self, token: int) -> str:
        """Append a token; return the complete text it added (possibly '')."""
        self.window.append(token)
        if token in self.held:  # (a byte run: final once a token outside it ends it)
            return ""
        if self.open_run:
            self._settle()
        text = self.decode(self.window)
        complete = text.rstrip("\ufffd")
        # (returned never goes down: a context that ends inside a character, which the
        # new tokens complete, keeps that character in the context's text)
        new, self.returned = complete[self.returned:], max(self.returned, len(complete))
        if len(complete) == len(text) and new:  # a clean boundary: the new tokens become the next context
            # (not tokens that added no text, e.g. special tokens the decode skips: as a context they
            # would decode to nothing, and a decoder that strips a decode's leading space would strip
            # the next word's)
            del self.window[: self.context]
            self.context = len(self.window)
            self.returned = len(self.decode(self.window))
        return new

    def pending(self) -> str:
        """The text a trailing run of held tokens adds if the tokens end here, where it is
        final so far: the run's bytes are valid UTF-8 that ends at a character boundary, or
        (with byte values) already invalid ('' otherwise, and where no run is open): a stop
        string may complete in it (a later byte could still turn a valid run into U+FFFD
        characters, so it is not returned by :meth:`push`)."""
        if len(self.window) == self.context or self.window[-1] not in self.held:
            return ""
        text = self.decode(self.window)[self._context_chars() if self.open_run else self.returned:]
        if "\ufffd" in text and isinstance(self.held, Mapping):  # a run already invalid stays so: final
            data = bytes(self.held[t] for t in self.window[self._run_start(len(self.window)):])
            try:
                codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
            except UnicodeDecodeError:
                return text
        return "" if "\ufffd" in text else text

    def flush(self) -> str:
        """The text not returned yet: trailing U+FFFD characters and a trailing run of held
        tokens ('' if none)."""
        if len(self.window) == self.context:
            return ""
        if self.open_run:
            self._settle()
        return self.decode(self.window)[self.returned:]


class Stopper:
    """Token-at-a-time stop decisions over the tokens of whole rounds (see the module).

    Args:
        decode: token ids -> text.
        stops: stop strings (non-empty).
        stop_ids: stop token ids.
        max_new_tokens: most tokens to generate (>= 1).
        min_tokens: tokens generated before stop strings are looked for (0 to ``max_new_tokens``).
        include_stop: the output text keeps the stop string that ended it (vLLM's
            ``include_stop_str_in_output``; the text is cut after it instead of before).
        held: byte tokens, whose text waits for the end of their run (see :class:`IncrementalText`).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], stop_ids, max_new_tokens: int,
                 min_tokens: int = 0, include_stop: bool = False, held: Collection[int] = frozenset()):
        self.text = IncrementalText(decode, held)
        self.stops, self.stop_ids, self.max_new_tokens = list(stops), stop_ids, max_new_tokens
        self.min_tokens, self.include_stop = min_tokens, include_stop
        self.generated = 0  # tokens kept so far
        self.unsent = ""  # text decided but not yet returned (held back: a stop string may start in it)
        self.prompt_tail: list[int] | None = None  # (start: the context, taken at the first feed)

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Take the prompt's last tokens as the text's context (before the first :meth:`feed`,
        which decodes them): the last ``CONTEXT_TOKENS`` of them, more while those decode to
        no text (special tokens the decode skips: twice as many) or start inside a
        character of a byte-fallback run (a held token whose text starts with U+FFFD: one
        more, back to the character's first byte), at most ``4 * CONTEXT_TOKENS``."""
        self.prompt_tail = list(prompt_ids[-4 * CONTEXT_TOKENS:])

    def _take_context(self) -> None:
        tail, self.prompt_tail = self.prompt_tail, None
        n = min(CONTEXT_TOKENS, len(tail))
        while n < len(tail):
            text = self.text.decode(tail[-n:])
            if not text:  # (special tokens the decode skips)
                n = min(2 * n, len(tail))
            elif tail[-n] in self.text.held and text.startswith("\ufffd"):  # (inside a byte run's character:
                n += 1  # the output's byte tokens would join an invalid run; back to the character's start)
            else:
                break
        self.text.start(tail[len(tail) - n:])

    def feed(self, tokens: Sequence[int]) -> tuple[str, int, str | None]:
        """Walk one round's committed tokens in order.

        Returns:
            ``(text, kept, finish)``: the text to emit now, how many of ``tokens`` are
            kept (all of them unless generation ends in this round) and the finish
            reason (``"stop"``, ``"length"``, or None while generation goes on).
        """
        if self.prompt_tail is not None:
            self._take_context()
        for kept, token in enumerate(tokens, 1):
            self.generated += 1
            if token in self.stop_ids:
                return self._finish(kept, "stop")
            new = self.text.push(token)
            if new:
                new_from = len(self.unsent)
                self.unsent += new
                cut = find_stop(self.unsent, new_from, self.stops, self.include_stop) \
                    if self.generated > self.min_tokens else None
                if cut is not None:
                    text, self.unsent = self.unsent[:cut], ""
                    return text, kept, "stop"
            elif self.stops and token in self.text.held and self.generated > self.min_tokens:
                # a stop string completed inside a byte run still open: the output ends at this
                # token, so the run ends here too and its text so far is final
                run = self.text.pending()
                cut = find_stop(self.unsent + run, len(self.unsent), self.stops, self.include_stop) if run else None
                if cut is not None:
                    text, self.unsent = (self.unsent + run)[:cut], ""
                    return text, kept, "stop"
            if self.generated >= self.max_new_tokens:
                return self._finish(kept, "length")
        hold = partial_stop(self.unsent, self.stops)
        text, self.unsent = self.unsent[: len(self.unsent) - hold], self.unsent[len(self.unsent) - hold:]
        return text, len(tokens), None

    def _finish(self, kept: int, reason: str) -> tuple[str, int, str]:
        """The rest of the text. Trailing U+FFFD characters become final here, so a stop
        string that contains U+FFFD may complete in them."""
        new_from = len(self.unsent)
        text, self.unsent = self.unsent + self.text.flush(), ""
        cut = find_stop(text, new_from, self.stops, self.include_stop) if self.generated > self.min_tokens else None
        if cut is not None:
            text, reason = text[:cut], "stop"
        return text, kept, reason
