"""Self-distillation: training sequences whose continuations are the target's own
greedy output, so the drafter learns to predict what the target will actually say.

Prompts come from the training data only: chat conversations (everything before the
last assistant turn) and prefixes of text documents (from a random line start, a length
drawn from ``prefix_min..prefix_max`` tokens, cut back to a line end: as short as
``prefix_min // 2`` tokens, :func:`text_prompts`). The target then extends each prompt
greedily up to ``seq_len`` tokens in total.

Generation is batched with the target's Hugging Face model class (``transformers``,
left padding, KV cache); this is data preparation, not the inference path, which
stays in :mod:`dflash_torch.decoding`.
"""

from __future__ import annotations

import contextlib
import random
import re
import sys
from pathlib import Path

import torch

from ..errors import first_line, named
from ..tokenizer import transformers_config
from .data import Corpus, Example, chat_prompt


def text_prompts(tokenizer, documents: list[str], n: int, prefix_min: int, prefix_max: int, rng: random.Random) -> list[list[int]]:
    """Up to ``n`` prompts (token ids) cut from random line starts of ``documents`` (picked by
    length): from each start a length is drawn from ``prefix_min..prefix_max`` tokens, the
    text of that many tokens is cut back to its last line end (where it holds one after its
    first character), and the prompt is kept where it has at least ``max(1, prefix_min // 2)``
    tokens and some non-blank text: a prompt has ``max(1, prefix_min // 2)`` tokens at least and
    about ``prefix_max`` at most (the cut text encoded again, with any special token the
    tokenizer adds in front). The prompts differ from each other (a repeated prompt is drawn
    again: its greedy continuation would repeat a sequence, trial-272). Fewer than ``n`` come
    back where ``20 * n`` draws do not find them."""
    docs = [d for d in documents if d.strip()]
    if not docs or n <= 0:
        return []
    weights = [len(d) for d in docs]
    line_starts: dict[int, list[int]] = {}
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    tries = 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        k = rng.choices(range(len(docs)), weights)[0]
        doc = docs[k]
        if k not in line_starts:
            line_starts[k] = [0] + [m.end() for m in re.finditer("\n", doc) if m.end() < len(doc)]
        start = rng.choice(line_starts[k])
        want = rng.randint(prefix_min, prefix_max)
        ids = tokenizer.encode(doc[start:start + 16 * want], add_special_tokens=False)[:want]
        piece = tokenizer.decode(ids)
        cut = piece.rfind("\n")
        if cut > 0:
            piece = piece[:cut + 1]
        prompt = tokenizer.encode(piece)
        if len(prompt) >= max(1, prefix_min // 2) and piece.strip() and tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            out.append(prompt)
    return out


@torch.no_grad()
def greedy_continuations(model, prompts: list[list[int]], max_new: list[int], pad_id: int,
                         stop_ids: list[set[int] | None] | None = None, batch_size: int = 32, progress: bool = True) -> list[list[int]]:
    """Greedy continuations of ``prompts`` with a Hugging Face causal LM.

    Prompts are sorted by length and run ``batch_size`` at a time with left padding.
    ``stop_ids[i]`` (optional): cut continuation ``i`` after its first stop token.
    EOS does not stop generation otherwise. ``progress``: a progress bar on stderr, where
    that is a terminal.
    """
    import inspect

    from tqdm import tqdm

    # transformers renamed ``past_key_values`` to ``cache`` during the 5.x series
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts), desc="self-distill", unit="seq", disable=None if progress else True,  # (None: not
               dynamic_ncols=True)  # where stderr is not a terminal: a log file filled with its redraws, trial-284)
    for c in range(0, len(order), batch_size):
        chunk = order[c:c + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, i in enumerate(chunk):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        steps = max(max_new[i] for i in chunk)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        nxt = res.logits[:, -1].argmax(-1)
        last = pos[:, -1]
        gen = [nxt]
        for _ in range(steps - 1):
            mask = torch.cat([mask, torch.ones(len(chunk), 1, dtype=torch.long)], dim=1)
            last = last + 1
            past = getattr(res, cache_arg, None)
            res = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                        use_cache=True, **{cache_arg: past})
            nxt = res.logits[:, -1].argmax(-1)
            gen.append(nxt)
        gen_t = torch.stack(gen, dim=1)
        for r, i in enumerate(chunk):
            toks = gen_t[r, :max_new[i]].tolist()
            stops = stop_ids[i] if stop_ids is not None else None
            if stops:
                for j, t in enumerate(toks):
                    if t in stops:
                        toks = toks[:j + 1]
                        break
            out[i] = toks
        bar.update(len(chunk))
    bar.close()
    return out


def distill_prompts(tokenizer, corpus: Corpus, n: int, seq_len: int, *, prefix_min: int = 32, prefix_max: int = 256,
                    seed: int = 0, template_kwargs: dict | None = None,
                    counts: dict | None = None) -> tuple[list[list[int]], list[bool]]:
    """Up to ``n`` prompts (token ids) for self-distillation and whether each is a chat prompt.

    Chat prompts (everything before a conversation's last assistant turn) are drawn in
    proportion to the conversations' share of the corpus, without replacement, and kept when
    shorter than ``seq_len - 16`` tokens (rendered with the extra chat template variables
    ``template_kwargs``) and unlike every prompt drawn before: a greedy continuation of a
    repeated prompt would repeat its sequence (and copy training rows into the held-out split:
    trial-272), so where more are asked than the conversations hold distinct prompts, each is
    drawn once and text prompts, where there is text, make up the rest; text prompts are cut by :func:`text_prompts` from a length drawn
    from ``prefix_min..prefix_max`` tokens (at most ``seq_len - 16``), cut back to a line end:
    ``prefix_min // 2`` tokens at least. Fewer than ``n`` come back when the data is too short
    to cut them.

    ``counts``, where given, is filled with ``chat_asked`` (the chat prompts wanted),
    ``chat_distinct`` (those found) and ``chat_repeated`` (conversations passed over as their
    prompt repeated an earlier one's).
    """
    rng = random.Random(seed)
    prefix_max = min(prefix_max, seq_len - 16)
    prefix_min = min(prefix_min, prefix_max)
    n_chat = 0
    if corpus.conversations:
        share = len(corpus.conversations) / (len(corpus.conversations) + len(corpus.documents))
        n_chat = round(n * share)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    order = list(range(len(corpus.conversations)))
    rng.shuffle(order)  # (each conversation once)
    for k in order:
        if len(prompts) >= n_chat:
            break
        p = chat_prompt(tokenizer, corpus.conversations[k], seq_len - 15, corpus.source(k), template_kwargs)
        if tuple(p) in seen:
            repeated += 1
        elif 0 < len(p) <= seq_len - 16:
            seen.add(tuple(p))
            prompts.append(p)
    if counts is not None:
        counts.update(chat_asked=n_chat, chat_distinct=len(prompts), chat_repeated=repeated)
    chat = [True] * len(prompts)
    texts = text_prompts(tokenizer, corpus.documents, n - len(prompts), prefix_min, prefix_max, rng)
    return prompts + texts, chat + [False] * len(texts)


def _stderr_is_terminal() -> bool:
    """Whether stderr is a terminal, where progress bars are drawn (a file or pipe is not)."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # (a stream without isatty, or closed)
        return False


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """transformers' progress bars on (as they were) or off within the block."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def load_distill_model(target_dir: Path, dtype: torch.dtype = torch.float32):
    """The target in ``target_dir`` as transformers runs it (eval mode, ``dtype``), for
    self-distillation: ``AutoModelForCausalLM``'s class for its config, or, for a config it
    does not map (a multimodal wrapper such as GLM-5.3-Flash's ``glm5_next``: it failed with
    transformers' "Unrecognized configuration class" traceback, trial-263), the class that
    ``config.json``'s ``architectures`` names in transformers, else
    ``AutoModelForImageTextToText``'s; it is given text only.

    Raises:
        OptionError: transformers cannot load it (its message's first line), naming ``self_distill``.
    """
    import transformers

    try:
        config = transformers_config(target_dir)  # (read by dflash-torch first: transformers' notices on it silenced)
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), config=config,
                                                                     dtype=dtype).eval()
        except ValueError as exc:  # (a config class AutoModelForCausalLM does not map)
            if "Unrecognized configuration class" not in str(exc):
                raise
        named_class = next((getattr(transformers, name, None) for name in (getattr(config, "architectures", None) or [])
                            if isinstance(name, str) and hasattr(getattr(transformers, name, None), "from_pretrained")),
                           None)
        loader = named_class or transformers.AutoModelForImageTextToText
        return loader.from_pretrained(str(target_dir), config=config, dtype=dtype).eval()
    except (ImportError, KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # (transformers' refusal, or a class it lacks: a traceback)
        raise named(f"self_distill runs the target with transformers, which cannot load it ({first_line(exc)}); "
                    "train without self_distill", "self_distill") from None


def self_distill(target_dir: Path, tokenizer, prompts: list[list[int]], chat: list[bool], seq_len: int, *,
                 batch_size: int = 32, dtype: torch.dtype = torch.float32, progress: bool = True) -> list[Example]:
    """One self-distilled example per prompt (see :func:`distill_prompts`): prompt + the
    target's greedy continuation up to ``seq_len`` tokens, loss on the continuation only.

    Text prompts are continued for the full length (EOS does not stop them: the
    continuation past it is still the target's greedy output); chat prompts
    (``chat[i]``) stop at EOS. The target is run by transformers (:func:`load_distill_model`),
    on text only. ``progress``: progress bars on stderr, where that is a terminal.

    Raises:
        OptionError: a target transformers cannot load, naming ``self_distill``.
    """
    if not prompts:
        return []
    # (transformers draws one while it loads the weights: where stderr is a terminal, as the others)
    with _progress_bars(progress and _stderr_is_terminal()):
        model = load_distill_model(target_dir, dtype)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    stops = [({eos} if c and eos is not None else None) for c in chat]
    conts = greedy_continuations(model, prompts, [seq_len - len(p) for p in prompts], pad, stops, batch_size, progress)
    del model
    examples = []
    for p, c in zip(prompts, conts):
        ids = torch.tensor(p + c, dtype=torch.long)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(p):] = True
        examples.append(Example(ids, mask))
    return examples
