"""Training data for a DFlash drafter: read a corpus, tokenize it, draw batches.

Inputs (``--data``, any mix):

* a plain text file (any extension but ``.jsonl`` / ``.json``, in any case): one document;
* a directory: every regular, non-hidden file below it (sorted): ``.jsonl`` files and
  ``.json`` files of records as below, other UTF-8 files (a ``.json`` file that is not
  records too; one whose first record is an object with ``text`` or ``messages`` must be
  valid records) one document each;
* a ``.jsonl`` file: one record per line, either ``{"text": str}`` (a document) or
  ``{"messages": [{"role", "content"}, ...]}`` (a chat conversation, rendered with the
  target tokenizer's chat template), not both; messages as the engine's chat path takes
  them (:meth:`~dflash_torch.engine.DFlashEngine.encode_prompt`: a content string or list
  of text parts, ``tool_calls`` with a None content, ``name``, ``tool_call_id``), each
  role one of ``system``, ``developer``, ``user``, ``assistant``, ``tool`` (others, e.g.
  ShareGPT's ``human`` / ``gpt``, are refused), and a message's ``reasoning_content``
  string is kept (a null one is absent);
* a ``.json`` file: a JSON array of such records, one record, or records one per line
  (as Hugging Face ``datasets``' JSON loader reads them).

A file given must be UTF-8 text; in a directory, files that are not are skipped, but not
its ``.jsonl`` files and ``.json`` files of records, which are data meant as such (a file
or directory this process may not read is refused, naming it, not skipped). Bad
bytes, bad JSON and strings that are not valid Unicode are refused naming the file and
line. Text is tokenized in bounded pieces (:func:`text_pieces`): the memory it takes
grows with the corpus, not with its longest line.

Two kinds of training sequences come out of it:

* **raw windows**: documents are tokenized, each followed by the EOS token, and
  concatenated into one stream; a batch row is a random ``seq_len`` window of it
  (loss on every position);
* **examples**: separate sequences with a loss mask: chat conversations (loss on the
  assistant turns when the template renders turn by turn consistently or the messages'
  contents are found in the rendered text, and the span found holds the reply and no
  other message's text, else everywhere;
  one with no assistant turn has no loss, and training leaves it out) and self-distilled
  sequences (prompt + the target's own greedy continuation, loss on the continuation;
  see :mod:`.distill`).

The text of the drafter's mask token (an added token such as ``<|MASK|>``) where the data
holds it is tokenized as plain text, not as the mask id (:class:`MaskAsText`).

Batches are a pure function of ``(seed, step)`` so a resumed run draws exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..chat_template import CHAT_ROLES, chat_messages, render_chat
from ..errors import DFlashError


@dataclass
class Corpus:
    """Raw inputs: plain documents and chat conversations.

    ``conversation_sources[i]`` names where conversation ``i`` comes from (``path:line``),
    ``document_sources[i]`` where document ``i`` does (its file, or ``path:line`` of its record);
    ``skipped`` lists the files of directories that were left out as not UTF-8 text;
    ``excluded`` the directories below a given directory that were left out as asked
    (``exclude`` of :func:`read_corpus`); ``empty_conversations`` names the records whose
    ``messages`` list is empty (``path:line``; left out, counted in the data statistics).
    """

    documents: list[str] = field(default_factory=list)
    conversations: list[list[dict]] = field(default_factory=list)
    conversation_sources: list[str] = field(default_factory=list)
    document_sources: list[str] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    excluded: list[Path] = field(default_factory=list)
    empty_conversations: list[str] = field(default_factory=list)

    def source(self, i: int) -> str:
        """Where conversation ``i`` comes from, for error messages."""
        return self.conversation_sources[i] if i < len(self.conversation_sources) else f"conversation {i}"

    def document_source(self, i: int) -> str:
        """Where document ``i`` comes from, for messages."""
        return self.document_sources[i] if i < len(self.document_sources) else f"document {i}"


def corpus_files(paths: list[str | Path], exclude: list[str | Path] = (),
                 excluded: list[Path] | None = None) -> list[tuple[Path, bool]]:
    """The files :func:`read_corpus` reads for ``paths``, in reading order, each with
    whether it was given itself (``True``) or found in a given directory (``False``).

    Links below a given directory are followed, each directory read once (by its real path),
    and each file once in the whole run (by its device and inode: a file reached through two
    links, a link and its own name, a hard link, two ``paths`` that overlap or name it twice):
    at its first path, in the order of ``paths`` and, within a directory, in sorted order. A directory of ``exclude`` found below a given directory (itself or
    through a link) is left out with everything below it (and appended to ``excluded`` when
    given): a run's own output directory inside its data directory.

    Raises:
        DFlashError: a path that does not exist or is not a regular file or a directory (a
            FIFO, a device), or a directory (a non-hidden one below a
            given directory too) that this process may not read.
    """
    def unreadable(exc: OSError):
        raise DFlashError(f"cannot read {exc.filename}: {exc.strerror or exc}")

    skip = {os.path.realpath(os.path.expanduser(e)) for e in exclude}
    files: list[tuple[Path, bool]] = []
    taken: set[tuple[int, int]] = set()  # (device, inode) of the files taken: one file is read once in the run

    def take(f: Path, given: bool) -> None:
        st = f.stat()
        if (st.st_dev, st.st_ino) not in taken:
            taken.add((st.st_dev, st.st_ino))
            files.append((f, given))

    for p in paths:
        path = Path(os.path.expanduser(p))
        try:
            if path.is_dir():
                found, seen = [], {os.path.realpath(path)}
                # (rglob passed over unreadable ones; links to directories are followed, each directory read once:
                # a link back up the tree would loop)
                for top, dirs, names in os.walk(path, onerror=unreadable, followlinks=True):
                    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                    for d in list(dirs):
                        real = os.path.realpath(Path(top, d))
                        if real in skip and excluded is not None and Path(top, d) not in excluded:
                            excluded.append(Path(top, d))
                        if real in skip or real in seen:
                            dirs.remove(d)
                        seen.add(real)
                    found += [Path(top, n) for n in names if not n.startswith(".")]
                for f in sorted(found):  # (a file reached through two links was read twice: duplicated data)
                    if f.is_file():
                        take(f, False)
            elif path.is_file():  # (a file given again, or also found in a given directory, is read once)
                take(path, True)
            elif path.exists():  # (a FIFO, a pipe, /dev/null: "does not exist" was said)
                raise DFlashError(f"training data {path} is not a regular file")
            else:
                raise DFlashError(f"training data {path} does not exist")
        except PermissionError as exc:  # (is_file of a link into a directory that may not be entered)
            raise DFlashError(f"cannot read {exc.filename}: Permission denied") from None
    return files


def _decode(data: bytes, path: Path, line: int = 1) -> str:
    """``data`` (the bytes of ``path`` from line ``line`` on) as text; a leading BOM is dropped.

    Raises:
        DFlashError: bytes that are not UTF-8, naming the file and line.
    """
    try:
        return data.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        n = line + data.count(b"\n", 0, exc.start)
        raise DFlashError(f"{path}:{n}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def _check_unicode(text: str, where: str) -> str:
    """``text`` unchanged; JSON can spell lone UTF-16 surrogates, which no tokenizer takes.

    Raises:
        DFlashError: ``text`` holds an unpaired surrogate.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DFlashError(f"{where}: the text holds an unpaired surrogate \\u{ord(text[exc.start]):04x} "
                          "(not valid Unicode)") from None
    return text


# The roles a training record's messages may take: the server's (an "ipython" or other role a
# template may know is refused too: neither the loss mask nor the server treats it, trial-275).
TRAIN_ROLES = CHAT_ROLES
_ROLE_HINTS = {"human": "user", "gpt": "assistant"}  # (ShareGPT's names)


def _check_roles(messages: list[dict], where: str) -> None:
    """Refuse a message whose role is not one of :data:`TRAIN_ROLES`: it trained unsaid, and
    only ``assistant`` turns get loss, so a ShareGPT ``"gpt"`` reply was dropped from it.

    Raises:
        DFlashError: naming ``where`` (file:line), the message's index and its role, with the
            role meant for ShareGPT's ``"human"`` / ``"gpt"``.
    """
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in TRAIN_ROLES:
            hint = _ROLE_HINTS.get(role.lower()) if isinstance(role, str) else None
            raise DFlashError(f"{where}: message {i} has role {role!r}, which training does not take: roles are "
                              + ", ".join(TRAIN_ROLES) + " (only assistant turns get loss)"
                              + (f"; for ShareGPT-style data write {role!r} as {hint!r}" if hint else ""))


def _add_record(rec, where: str, corpus: Corpus) -> None:
    if isinstance(rec, dict):  # (a null field is an absent one, as datasets' JSON writer leaves the other kind's)
        rec = {k: v for k, v in rec.items() if not (k in ("text", "messages") and v is None)}
    if isinstance(rec, dict) and "text" in rec and "messages" in rec:
        raise DFlashError(f"{where}: a record holds either a 'text' string or a 'messages' list, not both")
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        corpus.documents.append(_check_unicode(rec["text"], where))
        corpus.document_sources.append(where)
    elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
        bad = next((k for k, m in enumerate(rec["messages"]) if not isinstance(m, dict)), None)
        if bad is not None:  # (the engine's words would offer token ids, which training records cannot hold)
            raise DFlashError(f"{where}: message {bad} is not an object: each message must be "
                              "{'role': str, 'content': str}")
        try:  # (the messages the engine's chat path takes, as it takes them)
            msgs = chat_messages(rec["messages"], check_tool_call_ids=False)  # (a dataset's ids may not match)
        except DFlashError as exc:
            raise DFlashError(f"{where}: {exc}") from None
        _check_roles(msgs, where)
        # (a null reasoning_content is an absent one, as the chat API takes it)
        msgs = [{k: v for k, v in m.items() if not (k == "reasoning_content" and v is None)} for m in msgs]
        if any("reasoning_content" in m and not isinstance(m["reasoning_content"], str) for m in msgs):
            raise DFlashError(f"{where}: a message's reasoning_content must be a string")
        _check_unicode(json.dumps(msgs, ensure_ascii=False), where)
        if msgs:  # (a reasoning_content is kept: templates such as Qwen3's render it)
            corpus.conversations.append(msgs)
            corpus.conversation_sources.append(where)
        else:  # (counted and said: it was dropped unsaid, trial-272)
            corpus.empty_conversations.append(where)
    else:
        raise DFlashError(f"{where}: expected an object with a 'text' string or a 'messages' list")


def _read_jsonl(path: Path, corpus: Corpus) -> None:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = _decode(raw, path, n).strip()
            if not line:
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DFlashError(f"{where}: not valid JSON ({exc.msg})") from None
            except RecursionError:
                raise DFlashError(f"{where}: the JSON is nested too deeply to read") from None
            _add_record(rec, where, corpus)


def _looks_like_records(path: Path) -> bool:
    """Whether a ``.json`` file's first record (of an array, the object, or the first line)
    is an object with a ``text`` or ``messages`` field: records, whatever is wrong later."""
    try:
        text = path.read_text("utf-8-sig")
        try:
            first = json.loads(text)
        except ValueError:
            first = json.loads(text.lstrip().split("\n", 1)[0])
    except (ValueError, OSError, RecursionError):
        return False
    if isinstance(first, list):
        first = first[0] if first else None
    return isinstance(first, dict) and ("text" in first or "messages" in first)


def _read_json(path: Path, corpus: Corpus) -> None:
    """A ``.json`` file: an array of records (each named by its place, counted from 1, as a
    JSON Lines file's lines are), one record, else JSON Lines."""
    text = _decode(path.read_bytes(), path)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("["):
            raise DFlashError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        _read_jsonl(path, corpus)
        return
    except RecursionError:
        if text.lstrip().startswith("["):
            raise DFlashError(f"{path}: the JSON is nested too deeply to read") from None
        _read_jsonl(path, corpus)
        return
    for i, rec in enumerate(whole, 1) if isinstance(whole, list) else [(None, whole)]:
        _add_record(rec, f"{path}" + ("" if i is None else f": record {i}"), corpus)


def read_corpus(paths: list[str | Path], exclude: list[str | Path] = ()) -> Corpus:
    """Read text files, directories and JSONL files (see the module docstring), leaving
    out the directories of ``exclude`` found below a given directory (``Corpus.excluded``).

    A file given itself must be UTF-8; in a directory, files that are not UTF-8 text
    are skipped (listed in ``Corpus.skipped``), but its ``.jsonl`` files must be valid.

    Raises:
        DFlashError: a missing path, a file or directory this process may not read, a file
            given that is not UTF-8, malformed JSONL (naming the file and line), or no usable
            text at all.
    """
    corpus = Corpus()
    for path, given in corpus_files(paths, exclude, corpus.excluded):
        try:
            _read_file(path, given, corpus)
        except OSError as exc:  # (a file this process may not read is refused, not skipped: it is not bad data)
            raise DFlashError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not corpus.documents and not corpus.conversations:
        n = len(corpus.skipped)
        skipped = f" ({n} file{'s' * (n != 1)} skipped as not UTF-8 text)" if n else ""
        raise DFlashError(f"the training data {' '.join(map(str, paths))} holds no text{skipped}")
    return corpus


def _read_file(path: Path, given: bool, corpus: Corpus) -> None:
    """Add the file ``path`` (``given`` itself, else found in a directory) to ``corpus``, as
    :func:`read_corpus` describes."""
    if path.suffix.lower() == ".jsonl":
        _read_jsonl(path, corpus)
        return
    if path.suffix.lower() == ".json":
        records = Corpus()
        try:
            _read_json(path, records)
        except DFlashError:
            if given or _looks_like_records(path):
                raise
        else:  # (in a directory, a .json file that is not records, e.g. a package.json, is a document)
            corpus.documents += records.documents
            corpus.document_sources += records.document_sources
            corpus.conversations += records.conversations
            corpus.conversation_sources += records.conversation_sources
            return
    try:
        text = _decode(path.read_bytes(), path)
    except DFlashError:
        if given:
            raise
        corpus.skipped.append(path)
        return
    if text:
        corpus.documents.append(text)
        corpus.document_sources.append(str(path))


@dataclass
class Example:
    """One training sequence: token ids and which positions carry loss (bool)."""

    ids: torch.Tensor
    loss_mask: torch.Tensor
    whole: bool = False  # a conversation whose turns were not found: the loss covers all its tokens


PIECE_CHARS = 1 << 16
"""Longest text handed to the tokenizer in one piece (characters); see :func:`text_pieces`."""

CALL_CHARS = 1 << 18
"""Most characters of text per tokenizer call (pieces of several documents are batched)."""


def _cut(text: str, lo: int, hi: int) -> int:
    """The last cut in ``[lo, hi)`` just after a line end or just before a space that stands
    alone between two non-space characters; ``hi`` when there is none."""
    for sep, after in (("\n", 1), (" ", 0)):
        i = text.rfind(sep, lo, hi)
        while i > lo:
            if not text[i - 1].isspace() and not text[i + 1].isspace():
                return i + after
            i = text.rfind(sep, lo, i)
    return hi


def text_pieces(text: str, piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``piece_chars`` characters (one piece when it fits).

    A piece ends after a line end, else before a space, that stands alone between two
    non-space characters (the last such place in the second half of the piece). The
    byte-level BPE tokenizers of the supported families (GPT-2, Qwen and Llama 3
    pre-tokenizer patterns) end a pre-token there whatever follows, so for them the
    pieces' token ids, concatenated, are those of the whole text. With no such place
    (a very long word) the piece is cut at ``piece_chars``; tokens next to that cut may differ.
    """
    start = 0
    while len(text) - start > piece_chars:
        end = _cut(text, start + piece_chars // 2, start + piece_chars)
        yield text[start:end]
        start = end
    yield text[start:]


class MaskAsText:
    """``tokenizer`` (a fast one: character offsets) with the text of its added token
    ``mask_token_id`` (the drafter's mask token, e.g. ``<|MASK|>``) tokenized as plain text
    where the data holds it, not as that id: the mask id stands for a block's masked slots
    only (text holding it would look masked to the drafter, and it would learn to draft the
    id), and a target whose tokenizer gained the token for its drafter, as the DFlash
    reference adds ``<|MASK|>``, never saw that id: it writes that text, if at all, as plain
    tokens, which are what the drafter should draft. Where a text holds it, the stretch between the added tokens
    around it (which the tokenizer reads apart from the rest anyway) is tokenized with the
    special tokens read as text (``split_special_tokens``); the rest, the other special
    tokens (a chat template's markers) included, is tokenized as ``tokenizer`` does.
    Everything else is ``tokenizer``'s. Calls take a text or a list of texts and give
    ``input_ids`` (and ``offset_mapping`` when asked) as ``tokenizer`` does.

    Use :func:`mask_as_text` to make one (it says where this cannot be done)."""

    def __init__(self, tokenizer, mask_token_id: int, text: str):
        self.tokenizer, self.mask_token_id, self.text = tokenizer, mask_token_id, text
        self.boundaries = {int(i) for i in tokenizer.added_tokens_decoder} - {mask_token_id}

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def _plain(self, text: str, ids: list[int], offsets: list[tuple[int, int]]) -> tuple[list[int], list]:
        """``ids`` / ``offsets`` of ``text`` with each stretch holding the mask id tokenized as plain text."""
        out_ids, out_offsets, k = [], [], 0
        while k < len(ids):
            if ids[k] in self.boundaries:
                out_ids.append(ids[k])
                out_offsets.append(offsets[k])
                k += 1
                continue
            end = k
            while end < len(ids) and ids[end] not in self.boundaries:
                end += 1
            if self.mask_token_id in ids[k:end]:
                a, b = offsets[k][0], offsets[end - 1][1]
                enc = self.tokenizer(text[a:b], add_special_tokens=False, split_special_tokens=True,
                                     return_offsets_mapping=True)
                out_ids += enc["input_ids"]
                out_offsets += [(a + x, a + y) for x, y in enc["offset_mapping"]]
            else:
                out_ids += ids[k:end]
                out_offsets += offsets[k:end]
            k = end
        return out_ids, out_offsets

    def __call__(self, text, add_special_tokens: bool = True, return_offsets_mapping: bool = False, **kw):
        texts = [text] if isinstance(text, str) else list(text)
        if not any(self.text in t for t in texts):
            return self.tokenizer(text, add_special_tokens=add_special_tokens,
                                  return_offsets_mapping=return_offsets_mapping, **kw)
        enc = self.tokenizer(texts, add_special_tokens=add_special_tokens, return_offsets_mapping=True, **kw)
        ids, offsets = [], []
        for t, i, o in zip(texts, enc["input_ids"], enc["offset_mapping"]):
            i, o = self._plain(t, list(i), [tuple(x) for x in o]) if self.text in t else (list(i), list(o))
            ids.append(i)
            offsets.append(o)
        out = {"input_ids": ids[0] if isinstance(text, str) else ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets[0] if isinstance(text, str) else offsets
        return out

    def encode(self, text: str, add_special_tokens: bool = True, **kw) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens, **kw)["input_ids"]


def mask_as_text(tokenizer, mask_token_id: int | None):
    """``(tokenizer, text)``: :class:`MaskAsText` of ``tokenizer`` and the mask token's text
    where ``mask_token_id`` is an added token of it (not pad, BOS or EOS, which data holds as
    themselves) and a fast tokenizer reads that text as plain tokens; else ``tokenizer`` as
    it is and the text the data holding it becomes the mask id (None where no text is: a
    token of the vocabulary proper, read as such)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) if mask_token_id is not None else {}
    token = added.get(mask_token_id)
    if token is None or mask_token_id in {getattr(tokenizer, f"{k}_token_id", None) for k in ("pad", "bos", "eos")}:
        return tokenizer, None
    text = str(token)
    try:
        plain = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, KeyError, TypeError):  # (a slow tokenizer: no offsets)
        return tokenizer, text
    if mask_token_id in plain["input_ids"] or not plain["input_ids"]:
        return tokenizer, text
    return MaskAsText(tokenizer, mask_token_id, text), text


def encode_text(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of ``text`` (no special tokens added), tokenized in :func:`text_pieces` of
    :data:`PIECE_CHARS`; with ``max_tokens``, only the first ``max_tokens`` (later pieces
    are not tokenized)."""
    ids: list[int] = []
    for piece in text_pieces(text, PIECE_CHARS):
        ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids


def tokenize_documents(tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents as one int64 token stream ``[n]``, each followed by EOS (when the tokenizer has one).

    Documents are tokenized in :func:`text_pieces` of :data:`PIECE_CHARS`, at most :data:`CALL_CHARS` characters
    (and 256 pieces) per tokenizer call, so memory stays bounded for any document size.
    """
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    chunks: list[torch.Tensor] = []
    pieces: list[str] = []
    ends: list[bool] = []  # whether a piece ends its document
    chars = 0

    def flush() -> None:
        ids: list[int] = []
        for piece_ids, end in zip(tokenizer(pieces, add_special_tokens=False)["input_ids"], ends):
            ids += piece_ids + eos if end else piece_ids
        chunks.append(torch.tensor(ids, dtype=torch.long))
        pieces.clear()
        ends.clear()

    for doc in documents:
        for piece in text_pieces(doc, PIECE_CHARS):
            if pieces and (chars + len(piece) > CALL_CHARS or len(pieces) == 256):
                flush()
                chars = 0
            pieces.append(piece)
            ends.append(False)
            chars += len(piece)
        ends[-1] = True
    if pieces:
        flush()
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)


def _render_text(tokenizer, messages: list[dict], generation_prompt: bool, where: str,
                 template_kwargs: dict | None = None) -> str:
    """The messages rendered as the engine's chat path renders them (:func:`~dflash_torch.chat_template.render_chat`).

    Raises:
        DFlashError: the template refuses or cannot render them (naming ``where``)."""
    if not messages:  # (the turns before an opening assistant turn; transformers refuses to render none)
        return ""
    try:
        return render_chat(tokenizer, messages, {**(template_kwargs or {}), "add_generation_prompt": generation_prompt})
    except DFlashError as exc:
        raise DFlashError(f"{where}: {exc}") from None


def chat_prompt(tokenizer, messages: list[dict], max_tokens: int | None = None, where: str = "a conversation",
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of the prompt that precedes the last assistant turn (all turns if none),
    cut to its first ``max_tokens``; ``template_kwargs``: extra chat template variables."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return encode_text(tokenizer, _render_text(tokenizer, messages[:last], True, where, template_kwargs), max_tokens)


def _token_spans(tokenizer, text: str, max_tokens: int | None) -> list[tuple[int, int]] | None:
    """The character span ``(start, end)`` in ``text`` of each token of
    :func:`encode_text`'s ids (the same pieces); None when the tokenizer gives no offsets
    (a slow tokenizer)."""
    spans: list[tuple[int, int]] = []
    at = 0
    for piece in text_pieces(text, PIECE_CHARS):
        try:
            offsets = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        except (NotImplementedError, ValueError, KeyError):
            return None
        spans += [(at + a, at + b) for a, b in offsets]
        at += len(piece)
        if max_tokens is not None and len(spans) >= max_tokens:
            return spans[:max_tokens]
    return spans


def _assistant_span(tokenizer, messages: list[dict], i: int, text: str, where: str,
                    template_kwargs: dict | None = None, places: _Places | None = None) -> tuple[int, int] | None:
    """Where assistant turn ``i`` lies in ``text``, the whole conversation rendered, in
    characters; None when it cannot be found.

    It starts where ``text`` departs from the generation prompt that precedes the turn (at
    its end, or earlier where the template writes the turn's opening differently, e.g. a
    space instead of the prompt's line end), but not inside the turns before it: those,
    rendered alone, must be in ``text`` up to where the generation prompt adds to them (a
    template that renders earlier turns otherwise as the conversation goes on, e.g.
    Mistral's system prompt in the last user turn or a header that counts the messages,
    gives None). It ends at the end of the turn rendered alone, when that is
    a prefix of ``text``. A template may render the last assistant turn differently from
    earlier ones (Qwen3's writes an empty ``<think></think>`` into the last one only, and
    drops earlier turns' reasoning): the turn then ends at the end of the longest tail of
    its rendering alone (from a line start or a marker's end on: its last lines and the closing marker) that
    ``text`` has after the start and before the next message's content (the next content
    ``places`` has, when it placed every content: :func:`_content_places`); or, for a template
    that writes more after the last turn (Phi-3's end-of-text), at the end of the longest
    head of it (whole lines) that ``text`` has at the start."""
    before = _render_text(tokenizer, messages[:i], False, where, template_kwargs)
    prompt = _render_text(tokenizer, messages[:i], True, where, template_kwargs)
    turn = _render_text(tokenizer, messages[:i + 1], False, where, template_kwargs)
    content = messages[i].get("content")
    opening = -1
    if not messages[:i] and isinstance(content, str) and content.strip():  # (where the template writes the content:
        marker = _marker(i)  # not an earlier occurrence of its text, as in a default system prompt)
        try:
            marked = _render_text(tokenizer, _marked(messages, i), False, where, template_kwargs)
        except DFlashError:
            marked = ""
        head = marked[:marked.find(marker)] if marker in marked else None
        opening = len(head) if head is not None and turn.startswith(head) else turn.rfind(content)
    if opening >= 0:
        prompt = turn[:opening]  # (a conversation that opens with the reply: what the template writes first)
    start = len(os.path.commonprefix([prompt, text]))
    # the turns before it must be in ``text`` as they render alone: a template that renders them otherwise once the
    # conversation goes on (Mistral's system prompt in the last user turn, a header counting the messages) departs
    # inside them, and the loss would start on a user's text
    if start < max(len(os.path.commonprefix([before, text])), len(os.path.commonprefix([before, prompt]))):
        return None
    if text.startswith(turn) and len(turn) > start:
        try:  # the reply ends where a generation prompt would follow it (not at an end-of-text after the last turn)
            ended = _render_text(tokenizer, messages[:i + 1], True, where, template_kwargs)
        except DFlashError:
            ended = turn
        end = len(os.path.commonprefix([turn, ended]))
        if end < len(turn):  # (they part inside the next marker, "<|" of both: back to a line or a marker's end)
            end = max(turn.rfind("\n", start, end), turn.rfind(">", start, end)) + 1 or end
        return start, max(end, start + 1)
    body = turn[len(os.path.commonprefix([prompt, turn])):]
    nxt = messages[i + 1].get("content") if i + 1 < len(messages) else None
    limit = -1
    if places is not None and places.whole:  # (the next content the template writes, however empty or dropped
        limit = min((a for j, (a, _) in places.at.items() if j != i and a >= start), default=len(text))  # the next)
    elif isinstance(nxt, str) and nxt.strip():  # where the next message's text is: in the rendering up to it
        upto = _render_text(tokenizer, messages[:i + 2], False, where, template_kwargs)
        limit = upto.rfind(nxt, start, len(os.path.commonprefix([upto, text])))
        if limit < 0:
            limit = text.find(nxt, start)
    limit = len(text) if limit < 0 else limit
    lines = [k + 1 for k, c in enumerate(body) if c == "\n"]
    marks = [k + 1 for k, c in enumerate(body) if c in "\n>"]  # (gpt-oss writes no line ends: marker ends too)
    for cut in [0] + marks:  # the longest tail first
        tail = body[cut:]
        found = text.find(tail, start, limit) if tail.strip() else -1
        if found >= 0:
            return start, found + len(tail)
    for cut in reversed(lines):  # else the longest head (a template that writes more after its last turn)
        if body[:cut].strip() and text.startswith(body[:cut], start) and start + cut <= limit:
            return start, start + cut
    return None


_MARKER_OPENING = "@@dflash-content-"
_MARKERS = re.compile(re.escape(_MARKER_OPENING) + r"(\d+)@@")
"""The markers that stand for the messages' contents in a marked rendering (:func:`_marked`)."""


def _marker(k: int) -> str:
    """The marker of message ``k``'s content."""
    return f"{_MARKER_OPENING}{k}@@"


def _marked(messages: list[dict], j: int | None = None) -> list[dict]:
    """``messages`` (the first ``j + 1`` with ``j``) with each string content replaced by a marker naming it."""
    return [{**m, "content": _marker(k)} if isinstance(m.get("content"), str) else m
            for k, m in enumerate(messages[:None if j is None else j + 1])]


@dataclass
class _Places:
    """Where the messages' string contents lie in the rendered conversation (characters):
    ``at[j] = (start, end)`` for each content found, ``lost`` the indices of the contents the
    template writes otherwise (not found), ``whole``: every content was placed at once (the
    text is the template's text and the contents, each in its place)."""

    at: dict[int, tuple[int, int]]
    lost: set[int]
    whole: bool


def _fill(pieces: list[str], messages: list[dict], text: str) -> dict[int, tuple[int, int]] | None:
    """The places of the contents named by the markers in ``pieces`` (a marked rendering
    split at its markers) when, each marker replaced by its content (as given or stripped,
    as a ``trim`` writes it), it is ``text`` exactly; else None."""
    places: dict[int, tuple[int, int]] = {}
    at = 0
    for k in range(1, len(pieces), 2):
        literal, j = pieces[k - 1], int(pieces[k])
        if not text.startswith(literal, at) or j in places or j >= len(messages):
            return None
        at += len(literal)
        given = messages[j]["content"]
        value = given if text.startswith(given, at) else given.strip()
        if not text.startswith(value, at):
            return None
        places[j] = (at, at + len(value))
        at += len(value)
    return places if text[at:] == pieces[-1] else None


def _content_places(tokenizer, messages: list[dict], text: str, where: str,
                    template_kwargs: dict | None = None) -> _Places:
    """Where each message's string content lies in ``text`` (the conversation rendered).

    The conversation is rendered with each string content replaced by a marker (a reply's
    empty one left as it is where the template refuses that marked); where that
    rendering, each marker replaced by its content, is ``text`` exactly, every content's
    place is known. Else (a template that changes some content, as Qwen3's drops earlier
    replies' reasoning) each content is placed alone: rendered with only it replaced by a
    marker, a content is placed when that rendering, its marker replaced by it, is ``text``;
    one whose marker the template does not write is not in ``text`` at all."""
    strings = [j for j, m in enumerate(messages) if isinstance(m.get("content"), str)]
    if _MARKER_OPENING in text:  # (a text holding the markers' opening: no content could be told from them)
        return _Places({}, set(strings), False)
    # (a template may refuse the markers where it takes the contents, or write them otherwise: gpt-oss's refuses a
    # call's content with its thinking, and takes an empty one as none; Qwen3's writes a line end before a call only
    # after a content: then the replies' empty contents are left as they are, unplaced)
    marked = _marked(messages)
    for variant in (marked, [m if m["role"] == "assistant" and m.get("content") == "" else n
                             for m, n in zip(messages, marked)]):
        try:
            places = _fill(_MARKERS.split(_render_text(tokenizer, variant, False, where, template_kwargs)), messages, text)
        except DFlashError:
            continue
        if places is not None:
            return _Places(places, set(), True)
    found = _Places({}, set(), False)
    for j in strings:
        one = [{**m, "content": _marker(j)} if k == j else m for k, m in enumerate(messages)]
        try:
            pieces = _MARKERS.split(_render_text(tokenizer, one, False, where, template_kwargs))
        except DFlashError:
            pieces = None
        place = _fill(pieces, messages, text) if pieces is not None else None
        if place is not None:
            found.at.update(place)
        elif pieces is None or len(pieces) > 1:  # (refused, or written otherwise; no marker: not written at all)
            found.lost.add(j)
    return found


def _content_span(tokenizer, messages: list[dict], i: int, text: str, where: str,
                  template_kwargs: dict | None, places: _Places) -> tuple[int, int] | None:
    """Where assistant turn ``i`` lies in ``text``, found by its content's place (``places``,
    every content placed at once: :func:`_content_places`) instead of the turn-by-turn rendering (:func:`_assistant_span`'s
    fallback); None when it cannot be.

    The turn spans its content and what the template writes after it as the last turn
    (its closing marker), as far as ``text`` has it, or where ``text`` has none of that, what
    it writes after it before a generation prompt up to its first line or marker end, or where it
    writes neither (or refuses the conversation cut after the reply) but writes a closing after
    a last reply, what ``text`` has after it up to its first line or marker end; never
    into the next message's content (its content alone where the template refuses the
    conversation cut after it).
    """
    if not places.whole or i not in places.at:
        return None
    start = places.at[i][0]
    end = _closing_end(tokenizer, messages, i, text, where, template_kwargs, places)
    return (start, end) if end > start else None


def _closing_end(tokenizer, messages: list[dict], i: int, text: str, where: str, template_kwargs: dict | None,
                 places: _Places) -> int:
    """Where the closing the template writes after assistant turn ``i``'s content (placed by
    ``places``) ends in ``text``: :func:`_content_span`'s end."""
    marker = _marker(i)
    try:
        last = _render_text(tokenizer, _marked(messages, i), False, where, template_kwargs)
    except DFlashError:  # (Qwen3.5's refuses a conversation with no user turn yet: the content alone)
        last = None
    end = places.at[i][1]
    closing = last[last.find(marker) + len(marker):] if last is not None else ""
    shared = len(os.path.commonprefix([closing, text[end:]]))
    if shared < len(closing):  # (the next turn follows inside it: back to a line or a marker's end)
        shared = max(text.rfind("\n", end, end + shared), text.rfind(">", end, end + shared)) + 1 - end
        shared = max(shared, 0)
    if not shared:  # (gpt-oss closes the last reply with <|return|>, one a turn follows with <|end|>)
        try:
            ended = _render_text(tokenizer, _marked(messages, i), True, where, template_kwargs)
        except DFlashError:
            ended = marker
        agree = len(os.path.commonprefix([ended[ended.find(marker) + len(marker):], text[end:]]))
        ends = [k + 1 for k in (text.find("\n", end, end + agree), text.find(">", end, end + agree)) if k >= 0]
        shared = min(ends, default=end) - end  # (up to its first line or marker end: the next turn's opening not)
    if not shared and (last is None or closing):  # (a closing the template writes only where a turn follows it, a
        # </s>: one marker, spaces before it at most; never text up to a line end, which may hold the next turn's
        # header and, joined in a token, the start of its content)
        marker = re.match(r"[ \t]*<[^\s<>]+>", text[end:])
        shared = marker.end() if marker else 0
    limit = min((a for j, (a, _) in places.at.items() if j != i and a >= end), default=len(text))
    return min(end + shared, limit)


def _widened(span: tuple[int, int], content, text: str) -> tuple[int, int]:
    """``span`` started back at its reply's content where it starts inside it (a generation
    prompt that ends as the reply begins: DeepSeek-R1's ``<think>\\n`` before a reply that
    starts with ``<``)."""
    s, e = span
    mine = content.strip() if isinstance(content, str) else ""
    p = text.rfind(mine, 0, e) if mine else -1
    return (p, e) if 0 <= p < s < p + len(mine) <= e else span


def _completed(span: tuple[int, int], tokenizer, messages: list[dict], i: int, text: str, where: str,
               template_kwargs: dict | None, places: _Places) -> tuple[int, int]:
    """``span``, found for assistant turn ``i`` turn by turn, with the closing the template
    writes after the reply's text (its end-of-turn marker: what the drafter learns to stop on)
    where it ends at or before the end of that text (placed by ``places``): up to
    :func:`_closing_end` (a cut back to a line or marker end that lands at the end of a reply
    ending in one: gpt-oss's ``<|return|>`` or ``<|end|>`` after a reply ending in a line end)."""
    a, b = places.at.get(i, (0, 0))
    if b <= a or span[1] > b:
        return span
    try:
        return span[0], max(span[1], _closing_end(tokenizer, messages, i, text, where, template_kwargs, places))
    except DFlashError:
        return span


def _sound(span: tuple[int, int], messages: list[dict], i: int, text: str, places: _Places,
           taken: list[tuple[int, int]]) -> bool:
    """Whether ``span``, found for assistant turn ``i``, may carry its loss: it holds the
    reply's content (where that is not empty and ``text`` has it), it overlaps no other
    message's content (placed by ``places``; one the template writes otherwise must not be
    in the span outside the reply's content, unless another reply's), no other assistant
    turn's span (``taken``), and, for a reply before every other content (after the
    template's preamble alone), no earlier occurrence of the reply's text."""
    s, e = span
    if not 0 <= s < e <= len(text) or any(s < b and a < e for a, b in taken):
        return False
    content = messages[i].get("content")
    mine = content.strip() if isinstance(content, str) else ""
    if i in places.at:
        a, b = places.at[i]
        if b > a and not (s <= a and b <= e):
            return False
        first = not any(p < a for j, (p, _) in places.at.items() if j != i)  # (only the template's text before it)
        if first and mine and mine in text[s:a]:  # (it starts at an earlier occurrence of the reply's text: a default
            return False  # system prompt's "a helpful assistant" before a conversation that opens with that reply)
    elif mine and mine in text and mine not in text[s:e]:
        return False
    if any((a < e and b > s) if b > a else s < a < e for j, (a, b) in places.at.items() if j != i):
        return False
    rest = text[s:e].replace(mine, "\0", 1) if mine else text[s:e]
    return not any(messages[j]["content"].strip() and messages[j]["content"].strip() in rest
                   for j in places.lost if j != i and messages[j]["role"] != "assistant")


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int | None = None, where: str = "a conversation",
                          template_kwargs: dict | None = None) -> Example:
    """A chat conversation with loss on its assistant turns, cut to its first ``max_len``
    tokens (the part a training sequence can hold; the rest is not tokenized), rendered
    with the extra chat template variables ``template_kwargs`` (e.g. ``{"enable_thinking": False}``).

    Assistant turns are found in the rendered text (:func:`_assistant_span`: rendering the
    conversation turn by turn; else :func:`_content_span`: by the places of the messages'
    contents, from where the turn departs from its generation prompt when that is before the
    content, as gpt-oss's last reply's reasoning is), and a token carries the loss when its characters overlap one
    (a token that joins the generation prompt's last characters to the reply's first, as a
    byte-level BPE can, included). Either way a span is used only when it holds the reply's
    content, overlaps no other message's content (:func:`_content_places`) and no other
    reply's span (:func:`_sound`); a template that refuses a part of the conversation
    rendered alone leaves that method without a span. When a turn cannot be found so, or the
    tokenizer gives no character offsets, the loss covers every token instead
    (``Example.whole``); an empty reply in its place whose closing cannot be told carries no
    loss; a conversation with no assistant turn, or cut by ``max_len`` before its first
    reply, has no loss at all.

    Raises:
        DFlashError: no chat template, or one that refuses the conversation (naming ``where``).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError(f"{where}: chat ('messages') training data needs a tokenizer with a chat template")
    text = _render_text(tokenizer, messages, False, where, template_kwargs)
    full = encode_text(tokenizer, text, max_len)
    spans = _token_spans(tokenizer, text, max_len)
    mask = torch.zeros(len(full), dtype=torch.bool)
    consistent = spans is not None and len(spans) == len(full)
    places = _content_places(tokenizer, messages, text, where, template_kwargs) if consistent else None
    taken: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if not consistent or m["role"] != "assistant":
            continue
        turn = opened = None
        for find in (_assistant_span, _content_span):
            try:  # (a template may refuse the turns before a reply rendered alone: that method finds nothing)
                found = find(tokenizer, messages, i, text, where, template_kwargs, places)
            except DFlashError:
                found = None
            found = found and _widened(found, m.get("content"), text)
            if found is not None and find is _assistant_span:
                opened = found[0]  # (where the turn departs from its generation prompt)
                found = _completed(found, tokenizer, messages, i, text, where, template_kwargs, places)
            # found by its content: from where the turn departs from its generation prompt where that is before it
            # (gpt-oss's last reply's reasoning, written only in the last turn: the generation prompt's turn has none)
            wider = [(opened, found[1])] if find is _content_span and found and opened is not None and opened < found[0] \
                else []
            for span in wider + ([found] if found is not None else []):
                if _sound(span, messages, i, text, places, taken):
                    turn = span
                    break
            if turn is not None:
                break
        if turn is None and not (m.get("content") or "").strip() and not m.get("tool_calls") and i in places.at:
            continue  # (an empty reply, in its place, whose closing cannot be told from the next turn: no loss)
        if turn is None:
            consistent = False
            break
        taken.append(turn)
        mask |= torch.tensor([a < turn[1] and b > turn[0] for a, b in spans], dtype=torch.bool)
    if not consistent:
        mask[:] = True
    return Example(torch.tensor(full, dtype=torch.long), mask, whole=not consistent)


@dataclass
class Batch:
    """``ids`` int64 ``[b, T]`` (padded), ``lengths`` ``[b]``, ``loss_mask`` bool ``[b, T]``."""

    ids: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor


class TrainingData:
    """Raw-window stream + examples, and the deterministic batch sampler.

    Args:
        stream: int64 token stream of the raw documents (may be empty).
        examples: chat / self-distilled sequences (may be empty).
        seq_len: tokens per training sequence (longer examples are cut).
        pad_id: token id of padding (never attended to, never a label).
        raw_fraction: probability that a batch row is a raw window when both kinds exist.
    """

    def __init__(self, stream: torch.Tensor, examples: list[Example], seq_len: int, pad_id: int, raw_fraction: float):
        if stream.numel() < 2 and not examples:
            raise DFlashError("the training data is too short (fewer than 2 tokens)")
        self.stream, self.examples = stream, examples
        self.seq_len, self.pad_id = seq_len, pad_id
        if not examples:
            raw_fraction = 1.0
        elif stream.numel() < 2:
            raw_fraction = 0.0
        self.raw_fraction = raw_fraction

    def _raw(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.stream.numel()
        if n <= self.seq_len:
            ids = self.stream
        else:
            o = int(torch.randint(0, n - self.seq_len + 1, (1,), generator=gen))
            ids = self.stream[o:o + self.seq_len]
        return ids, torch.ones(ids.numel(), dtype=torch.bool)

    def _example(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.examples[int(torch.randint(0, len(self.examples), (1,), generator=gen))]
        return ex.ids[:self.seq_len], ex.loss_mask[:self.seq_len]

    def sample(self, batch: int, gen: torch.Generator) -> Batch:
        """``batch`` sequences drawn with ``gen`` (raw windows and examples mixed)."""
        rows = []
        for _ in range(batch):
            raw = float(torch.rand((), generator=gen)) < self.raw_fraction
            rows.append(self._raw(gen) if raw else self._example(gen))
        return collate(rows, self.seq_len, self.pad_id)


def collate(rows: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int, pad_id: int) -> Batch:
    """Pad ``(ids, loss_mask)`` rows to ``seq_len``."""
    b = len(rows)
    ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(b, seq_len, dtype=torch.bool)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, (r_ids, r_mask) in enumerate(rows):
        n = min(r_ids.numel(), seq_len)
        ids[i, :n], mask[i, :n], lengths[i] = r_ids[:n], r_mask[:n], n
    return Batch(ids, lengths, mask)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The random generator of one training step (a pure function of seed and step), for any
    ``seed`` ``torch.manual_seed`` takes: its seed is taken modulo 2**64, which torch does of a
    negative one too (the same generator), so that a large seed's product does not overflow it."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 7 + stream) % (1 << 64))
