"""Training data for a DFlash drafter: read a corpus, tokenize it, draw batches.

Inputs (``--data``, any mix):

* a plain text file (any extension but ``.jsonl``): one document;
* a directory: every regular, non-hidden file below it (sorted): ``.jsonl`` files as
  below, other UTF-8 files one document each;
* a ``.jsonl`` file: one record per line, either ``{"text": str}`` (a document) or
  ``{"messages": [{"role", "content"}, ...]}`` (a chat conversation, rendered with the
  target tokenizer's chat template).

Two kinds of training sequences come out of it:

* **raw windows**: documents are tokenized, each followed by the EOS token, and
  concatenated into one stream; a batch row is a random ``seq_len`` window of it
  (loss on every position);
* **examples**: separate sequences with a loss mask: chat conversations (loss on the
  assistant turns when the template renders turn by turn consistently, else everywhere)
  and self-distilled sequences (prompt + the target's own greedy continuation, loss on
  the continuation; see :mod:`.distill`).

Batches are a pure function of ``(seed, step)`` so a resumed run draws exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import DFlashError


@dataclass
class Corpus:
    """Raw inputs: plain documents and chat conversations."""

    documents: list[str] = field(default_factory=list)
    conversations: list[list[dict]] = field(default_factory=list)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_jsonl(path: Path, corpus: Corpus) -> None:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DFlashError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                corpus.documents.append(rec["text"])
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                msgs = rec["messages"]
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
                    raise DFlashError(f"{path}:{n}: messages must be a list of {{'role': str, 'content': str}}")
                if msgs:
                    corpus.conversations.append([{"role": m["role"], "content": m["content"]} for m in msgs])
            else:
                raise DFlashError(f"{path}:{n}: expected an object with a 'text' string or a 'messages' list")


def read_corpus(paths: list[str | Path]) -> Corpus:
    """Read text files, directories and JSONL files (see the module docstring).

    Raises:
        DFlashError: a missing path, malformed JSONL, or no usable text at all.
    """
    corpus = Corpus()
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                rel = f.relative_to(path)
                if f.is_file() and not any(part.startswith(".") for part in rel.parts):
                    if f.suffix == ".jsonl":
                        _read_jsonl(f, corpus)
                        continue
                    text = _read_text(f)
                    if text:
                        corpus.documents.append(text)
        elif path.is_file():
            if path.suffix == ".jsonl":
                _read_jsonl(path, corpus)
            else:
                text = _read_text(path)
                if text is None:
                    raise DFlashError(f"{path} is not UTF-8 text")
                if text:
                    corpus.documents.append(text)
        else:
            raise DFlashError(f"training data {path} does not exist")
    if not corpus.documents and not corpus.conversations:
        raise DFlashError("the training data holds no text")
    return corpus


@dataclass
class Example:
    """One training sequence: token ids and which positions carry loss (bool)."""

    ids: torch.Tensor
    loss_mask: torch.Tensor


def tokenize_documents(tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents as one int64 token stream, each followed by EOS (when the tokenizer has one)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for start in range(0, len(documents), 256):
        for doc in tokenizer(documents[start:start + 256], add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            if eos is not None:
                ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the prompt that precedes the last assistant turn (all turns if none)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return _render(tokenizer, messages[:last], True)


def tokenize_conversation(tokenizer, messages: list[dict]) -> Example:
    """A chat conversation with loss on its assistant turns.

    Assistant spans are found by rendering the conversation turn by turn; when the
    template is not prefix-consistent the loss covers every token instead.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashError("chat ('messages') training data needs a tokenizer with a chat template")
    full = _render(tokenizer, messages, False)
    mask = torch.zeros(len(full), dtype=torch.bool)
    consistent = True
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], True))
        end = len(_render(tokenizer, messages[:i + 1], False))
        if not (start <= end <= len(full)):
            consistent = False
            break
        mask[start:end] = True
    if not consistent or not mask.any():
        mask[:] = True
    return Example(torch.tensor(full, dtype=torch.long), mask)


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
    """The random generator of one training step (a pure function of seed and step)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + stream)
