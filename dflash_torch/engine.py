"""The Python API: load a target (+ drafter) once, generate many times.

    >>> from dflash_torch import DFlashEngine
    >>> engine = DFlashEngine.from_pretrained()          # the shipped default pair
    >>> out = engine.generate("def fibonacci(n):", max_new_tokens=64)
    >>> out.text, out.finish_reason, out.stats.mean_acceptance_length

Stopping is decided on committed tokens, token by token inside each block, exactly
as one-token-at-a-time decoding decides it (:mod:`dflash_torch.stopping`): the first
stop token id, the first token that completes a stop string, or ``max_new_tokens``,
whichever comes first; nothing past it is emitted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import logging
import operator
import os
import secrets
import threading
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from . import compute, options
from .batch import (SHARED_STARTS, BatchDecoder, check_draft_max_batch_size, check_engine_max_batch_size,
                    check_prefix_slots, check_shared_starts)
from .cache import common_start
from .aliases import ALIASES
from .chat_template import CHAT_ROLES, _not_messages_hint, chat_messages, render_chat, reserved_template_variables
from .checkpoint import available_memory, checkpoint_dir, load_config, memory_text, read_json_object
from .decoding import Round, SpeculativeDecoder, check_models
from .hub import cached_name, loaded_from
from .errors import ContextLengthError, DFlashError, OptionError, about_prompt, shown, unprintable
from .models.config import TargetConfig, check_vocab_ids, eos_token_ids
from .models.drafter_config import (DrafterConfig, NotADrafterError, fill_mask_token_id, needs_mask_token_id,
                                   validate_pair)
from .models.drafter import DFlashDrafter
from .models.fusing import fuse_by_default, fuse_projections
from .models.packing import pack_linears, packed_bytes, packing_supported
from .models.target import TargetModel
from .sampling import SamplingParams, TokenLogprob, covers_vocab, generation_defaults
from .stopping import Stopper
from .structured import GrammarCompiler, StructuredOutput
from .tokenizer import byte_level_alphabet, check_tokenizer_size, load_tokenizer, max_prompt_chars

ASSETS = Path(__file__).parent / "assets" / "default"
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFTER = ASSETS / "drafter"
log = logging.getLogger("dflash_torch")
STALLED_STREAM_S = 10.0  # seconds a request from a thread that has read an open stream waits for it to be read on
COLLECT_AFTER_S = 1.0  # seconds an open stream goes unread before a waiting request runs the garbage collector
SHARED_START_MIN = 32  # fewest tokens of a chat's leading system messages worth a snapshot (DFlashEngine.shared_end)
DEFAULT_MAX_NEW_TOKENS = 256  # a request that gives no max_new_tokens (and no generation_config.json's): this many,
# cut to the context its prompt leaves
_ENGINES: weakref.WeakSet = weakref.WeakSet()  # every engine of the process (for _after_fork)


def _after_fork() -> None:
    """In a forked child: an engine whose lock a parent's request held (a thread that does
    not exist in the child) is marked, so that the child's calls get an error, not a wait
    for ever."""
    for engine in list(_ENGINES):
        if engine.lock.locked():
            engine.lock, engine._forked_busy = threading.Lock(), True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@dataclass
class GenerationStats:
    """Measurements of one request. Times are in seconds.

    ``acceptance_lengths`` has one tau per decoding round (tokens committed by the
    round, bonus token included); ``acceptance_histogram`` maps tau -> rounds. The last
    round counts the tokens the output keeps (not those past ``max_new_tokens`` or a
    stop), as the DFlash reference's ``dflash_generate`` does, so
    ``1 + sum(acceptance_lengths) == generated_tokens``.
    ``decode_tokens_per_second`` counts the tokens after the first (which prefill
    produces) over ``decode_time``. ``cached_prompt_tokens``: prompt tokens taken from a
    retained prefix instead of read (prefix reuse, ``reuse_prefix``; else 0). A request
    that ends with the token prefill produced (e.g. an EOS, or ``max_new_tokens=1``) runs no
    decoding round: ``acceptance_lengths`` is then empty and ``mean_acceptance_length``,
    ``decode_time`` and ``decode_tokens_per_second`` are 0.0 (the CLI prints "no decoding
    round"; :meth:`to_dict`, so ``generate --json``, and the server's ``dflash`` object give
    ``mean_acceptance_length`` and ``decode_tokens_per_second``, and :meth:`to_dict` its
    ``mean_propose_time`` and ``mean_verify_time``, as None, JSON's null: tau is at least 1 by
    definition, and a 0.0 would pull an average over requests down).
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    block_size: int = 1
    draft_mode: str | None = None
    acceptance_lengths: list[int] = field(default_factory=list)
    mean_acceptance_length: float = 0.0
    acceptance_histogram: dict[int, int] = field(default_factory=dict)
    prefill_time: float = 0.0
    decode_time: float = 0.0
    decode_tokens_per_second: float = 0.0
    propose_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (``acceptance_histogram``'s keys as strings), with
        ``mean_propose_time`` and ``mean_verify_time`` (seconds per round, floats);
        ``mean_acceptance_length``, ``decode_tokens_per_second``, ``mean_propose_time`` and
        ``mean_verify_time`` are None where no decoding round ran (``acceptance_lengths``
        empty)."""
        d = asdict(self)
        d["acceptance_histogram"] = {str(k): v for k, v in self.acceptance_histogram.items()}
        d["mean_propose_time"] = sum(self.propose_times) / len(self.propose_times) if self.propose_times else 0.0
        d["mean_verify_time"] = sum(self.verify_times) / len(self.verify_times) if self.verify_times else 0.0
        if not self.acceptance_lengths:  # (no round: no tau, no decode rate, no time per round; not 0.0)
            for key in ("mean_acceptance_length", "decode_tokens_per_second", "mean_propose_time", "mean_verify_time"):
                d[key] = None
        return d


@dataclass
class GenerationResult:
    """A finished request.

    Attributes:
        text: the generated text (without a stop token's text, cut before a stop string):
            what the tokens add to the text of the prompt's last few tokens, as vLLM and
            transformers' pipelines decode it (a SentencePiece tokenizer's first word keeps
            its space; see :mod:`dflash_torch.stopping`).
        token_ids: generated token ids, up to and including the stop token (or the token
            that completed a stop string); never past it.
        finish_reason: ``"stop"`` (stop token or string, or a structured output complete at
            max_new_tokens where only the EOS could follow) or ``"length"`` (max_new_tokens).
        stats: :class:`GenerationStats`.
        logprobs: with ``logprobs=k`` (0 to 20), one :class:`~dflash_torch.sampling.TokenLogprob`
            per token of ``token_ids``: its natural-log probability under the target
            (float32 ``log_softmax`` of the target's raw logits at its position, before
            temperature / top-k / top-p) and the k most likely tokens there; else None.
        prompt_logprobs: with ``prompt_logprobs=k`` (0 to 20), one entry per prompt token:
            None for the first (nothing before it scores it), then the
            :class:`~dflash_torch.sampling.TokenLogprob` of each prompt token under the target
            at the position before it (same distribution as ``logprobs``), from the
            prefill's logits; else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class StreamChunk:
    """One streamed piece: a text delta and the token ids committed with it.
    ``finish_reason`` and ``stats`` are set on the last chunk only; ``logprobs`` (with
    ``logprobs=k``) has one :class:`~dflash_torch.sampling.TokenLogprob` per token id
    (see :class:`GenerationResult`), else None; ``prompt_logprobs`` (with ``prompt_logprobs=k``)
    is set on the first chunk only (see :class:`GenerationResult`)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@functools.cache
def _keywords(*takes: Callable) -> list[str]:
    """The names that the functions ``takes`` accept as keyword arguments (``self`` aside)."""
    return [name for f in takes for name, p in inspect.signature(f).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self"]


def _hint(name: str, known: list[str]) -> str:
    """What :func:`_check_arguments` adds to its message about the unknown keyword ``name``,
    given the arguments ``known`` of the method: `` (did you mean 'x'?)`` with the one that
    does its work (:data:`~dflash_torch.aliases.ALIASES`: ``stop_strings`` -> ``stop``, with a note where they
    differ), or for a request, what to do instead (``n``, ``pad_token_id``), or the argument
    of :meth:`DFlashEngine.from_pretrained` that does its work (``assistant_model``: load
    with ``draft``); for a name of no other library, a spelling close enough to be a typo
    (difflib's ratio >= 0.8: ``tempreature``; a looser match named arguments of other
    meanings, ``prefix_caching`` -> ``prefill_chunk``); ``""``: none (an alias of none of
    ``known``: ``do_sample`` of ``from_pretrained``)."""
    import difflib

    if name not in ALIASES:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        return f" (did you mean {close[0]!r}?)" if close else ""
    names, note = ALIASES[name]
    request = "prompt" in known or "prompts" in known
    if not names:  # (a note about a request)
        return f" ({note})" if request and note else ""
    close = next((n for n in names if n in known), None)
    if close is None and request:  # (an argument of the engine, not of a request: loaded with)
        loading = _keywords(DFlashEngine.from_pretrained)
        close = next((n for n in names if n in loading), None)
        return "" if close is None else f" (it is set when loading: DFlashEngine.from_pretrained({close}=...))"
    return "" if close is None else f" (did you mean {close!r}?{' ' + note if note else ''})"


def _check_arguments(method: str, kwargs: dict, *takes: Callable) -> None:
    """Raises TypeError, as Python does for ``method``, for a keyword that none of ``takes``
    accepts, naming the one they do that does its work (:func:`_hint`: ``max_tokens``: did you
    mean ``max_new_tokens``?)."""
    known = _keywords(*takes)
    for name in kwargs:
        if name not in known:
            raise TypeError(f"{method}() got an unexpected keyword argument {name!r}{_hint(name, known)}")


def _is_index(value) -> bool:
    """Whether ``value`` is an integer as a token id: its ``__index__`` gives one (an int, a
    NumPy integer, a 0-dim integer tensor; a float tensor or a tensor of several refuses)."""
    try:
        value.__index__()
        return True
    except (TypeError, AttributeError):
        return False


def is_shipped_target(target: str | Path | None) -> bool:
    """Whether ``target`` names the shipped default target's directory, by any path to it (it
    then drafts with the shipped drafter, as when no target is given)."""
    try:
        return target is not None and Path(os.path.expanduser(target)).resolve() == DEFAULT_TARGET.resolve()
    except (OSError, RuntimeError, ValueError):
        return False


def _check_printable(method: Callable, *args, **kwargs) -> None:
    """Raises OptionError, naming it, for an argument of ``method`` that is or holds an integer
    too long to print (``max_new_tokens=10**5000``): the message of the argument's own check,
    which prints the value, would be a ``ValueError`` (see :func:`~dflash_torch.errors.shown`)."""
    if any(map(unprintable, args)) or any(map(unprintable, kwargs.values())):
        bound = inspect.signature(method).bind_partial(*args, **kwargs).arguments
        name = next(n for n, v in bound.items() if n not in ("self", "cls") and unprintable(v))
        raise OptionError(f"{name} is or holds an integer of over 4,000 digits: far out of its range", name)


def _named_arguments(method: Callable) -> Callable:
    """``method``, whose unknown keyword argument is :func:`_check_arguments`' TypeError
    (with its hint) instead of Python's, and that refuses an argument too long to print
    (:func:`_check_printable`)."""
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        _check_arguments(method.__qualname__, kwargs, method)
        _check_printable(method, self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return checked


def _signature_of_generate(generate: Callable, stream: Callable) -> inspect.Signature:
    """:meth:`DFlashEngine.generate`'s signature as help() and ``inspect.signature`` show it:
    ``stream``'s (whose arguments it takes as ``**kwargs``), its own ``on_chunk`` and return
    annotation added."""
    own, streams = inspect.signature(generate), inspect.signature(stream)
    return streams.replace(parameters=[*streams.parameters.values(), own.parameters["on_chunk"]],
                           return_annotation=own.return_annotation)


class DFlashEngine:
    """A loaded target (+ optional DFlash drafter) and its tokenizer.

    One request runs at a time: a lock serialises threads. A stream holds the engine until
    its last chunk is read or it is closed. A request from a thread that has read an
    unfinished stream waits for it to be read on (by another thread of a pool: Starlette's
    ``iterate_in_threadpool``, asyncio's ``run_in_executor``) and raises
    :class:`DFlashError` where no thread has read it for ``STALLED_STREAM_S`` seconds (if
    only this thread reads it, it would never proceed); a stream that only a reference cycle
    keeps (an exception kept in a local, through its traceback) is closed first, by the
    garbage collector that such a request runs. Each request starts from clean caches, or from the rows of
    the last request's tokens that its prompt starts with (``reuse_prefix``, below).

    Any thread may call it: the torch work (loading, every decoding round) runs on the
    process's one compute thread (:mod:`dflash_torch.compute`), so calls from several
    threads never split torch across thread teams; tokenizing runs in the caller's thread.

    Raises :class:`DFlashError` for a ``tokenizer`` that is not one (no ``encode``,
    ``decode``, ``get_vocab``, ``convert_tokens_to_ids``, a ``__len__`` of its class: e.g. a
    ``tokenizers.Tokenizer``, or a wrapper forwarding attributes through ``__getattr__`` alone)
    or not the target's (more tokens than its ``vocab_size``, or fewer than half as many:
    :func:`~dflash_torch.tokenizer.check_tokenizer_size`, as :meth:`from_pretrained` checks
    it), a ``target`` / ``drafter`` that is not one, or a drafter in another dtype or on another device
    than the target (:func:`~dflash_torch.decoding.check_models`),
    a drafter not made for the target (``incompatible pair: ...``, as :meth:`from_pretrained`
    refuses it: :func:`~dflash_torch.models.drafter_config.validate_pair`) and the options' bad values.

    ``max_prompt_chars``: the longest text prompt (characters) that could fit
    ``max_context`` tokens; a longer one is refused without being tokenized.

    ``max_batch_size``: sequences :meth:`generate_batch` decodes together (the slots of
    :meth:`batch_decoder`, whose caches are allocated on first use); None: 8, or 1 with
    ``draft_mode="recompute"``, which decodes one sequence at a time (a larger value is
    refused there: it would have no effect).

    ``reuse_prefix``: the caches keep a finished sequence's rows and a later prompt that
    starts with its tokens (the next turn of a chat) reuses them instead of reading them
    again: one request at a time, the last request's (``SpeculativeDecoder(reuse_prefix=...)``),
    and in the batch decoder every finished sequence's that its slots can keep
    (``BatchDecoder(reuse_prefix=...)``);
    ``prefix_slots``: its slots that only keep such rows (``BatchDecoder(prefix_slots=...)``);
    ``shared_starts``: the most snapshots it keeps of shared prompt starts, for a hybrid or
    sliding-window target (``BatchDecoder(shared_starts=...)``).

    ``draft_max_batch_size``: the batch decoder's rounds of more than this many sequences run
    target-only, or ``"auto"``: where measured goodput favours it
    (``BatchDecoder(draft_max_batch_size=...)``; None: always draft).

    ``generation_defaults``: the sampling the target's ``generation_config.json`` recommends
    (:func:`~dflash_torch.sampling.generation_defaults`: ``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``repetition_penalty``, those it sets), as keyword arguments of
    :meth:`generate` (``engine.generate(prompt, **engine.generation_defaults)``); ``{}``
    without the file; a bad value there is an error when they are read, not when loading.
    The server's requests default to them (``serve --generation-config auto``);
    :meth:`generate` itself defaults to greedy decoding. The file's ``max_new_tokens``
    (``recommended_max_new_tokens``) is not among them: it is ``default_max_new_tokens``,
    which a request without ``max_new_tokens`` gets cut to the context its prompt leaves,
    as the server cuts it.

    ``default_max_new_tokens``: the ``max_new_tokens`` of a request that gives none, cut
    to the context its prompt leaves: :data:`DEFAULT_MAX_NEW_TOKENS` (256), or where
    :meth:`from_pretrained` finds a valid ``max_new_tokens`` in ``generation_config.json``,
    that value; may be set.

    ``warn_tools_left_out``: :meth:`encode_prompt` checks the first chat prompt with tools it
    renders (:meth:`tools_left_out`) and logs a WARNING to the ``dflash_torch`` logger where
    the chat template leaves the tools out (once per engine: the model is not told of them);
    True, may be set (the server sets it false: it logs its own, naming its tool-call format).
    """

    def __reduce__(self):
        raise TypeError("a DFlashEngine cannot be pickled (it holds its models, caches and locks): load it in each "
                        "worker process, or, with multiprocessing's fork start method, call a module-level function "
                        "that uses the engine the parent loaded")

    def __init__(self, target: TargetModel, tokenizer, drafter: DFlashDrafter | None = None,
                 block_size: int | None = None, draft_mode: str = "inject", name: str = "dflash",
                 max_batch_size: int | None = None, reuse_prefix: bool = True, draft_max_batch_size: int | str | None = None,
                 prefix_slots: int = 0, shared_starts: int = SHARED_STARTS, **decoder_options):
        _check_arguments("DFlashEngine.__init__", decoder_options, SpeculativeDecoder, DFlashEngine)
        # (len() looks __len__ up on the class: a wrapper that forwards attributes through __getattr__ lacks it)
        methods = all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode", "get_vocab",
                                                                      "convert_tokens_to_ids"))
        if not (methods and callable(getattr(type(tokenizer), "__len__", None))):
            lacks = " (its class has no __len__: len() does not look it up through __getattr__)" if methods else ""
            raise DFlashError(f"tokenizer must be a transformers tokenizer (e.g. AutoTokenizer.from_pretrained of the "
                              f"target's directory), got {type(tokenizer).__name__}{lacks}: DFlashEngine(target, "
                              "tokenizer, drafter) takes it second")
        self.target, self.tokenizer, self.drafter, self.name = target, tokenizer, drafter, name
        self.max_batch_size = check_engine_max_batch_size(max_batch_size, drafter=drafter is not None,
                                                          draft_mode=draft_mode)
        self.reuse_prefix = options.check_flag(reuse_prefix, "reuse_prefix")
        self.prefix_slots = check_prefix_slots(prefix_slots, self.reuse_prefix, draft_mode)
        self.shared_starts = check_shared_starts(shared_starts, self.reuse_prefix, draft_mode)
        self._batch: BatchDecoder | None = None
        self._max_context_option = decoder_options.get("max_context")  # (None: the target's context, for the batch decoder too)
        self._compile_backend = decoder_options.get("compile_backend", "inductor")  # (the batch decoder's too)
        check_models(target, drafter)
        if drafter is not None:  # (as from_pretrained checks the configs, before any round reads a wrong shape)
            validate_pair(target.config, drafter.config)
        check_tokenizer_size(tokenizer, target.config.vocab_size)  # (as from_pretrained's: load_tokenizer)
        self.decoder = compute.run(SpeculativeDecoder, target, drafter, block_size=block_size, draft_mode=draft_mode,
                                   reuse_prefix=self.reuse_prefix, **decoder_options)
        self.draft_max_batch_size = check_draft_max_batch_size(draft_max_batch_size, drafter=drafter is not None,
                                                               draft_mode=draft_mode, block_size=self.block_size)
        self.max_prompt_chars = max_prompt_chars(tokenizer, self.max_context)
        self.lock = threading.Lock()
        self._forked_busy = False  # (a forked child's copy of an engine that ran a request: _after_fork)
        _ENGINES.add(self)
        # the threads that have read the open stream (not their ids: a new thread may get a finished one's id),
        # whether one reads it now, when its last read ended (time.monotonic(), seconds) and whether a stream that
        # has been read holds the engine (not generate's request)
        self._readers: weakref.WeakSet = weakref.WeakSet()
        self._reading, self._read_at, self._stream_open = False, 0.0, False
        self.stop_token_ids = set(target.config.eos_token_ids)
        self._generation_defaults: dict | DFlashError = {}
        self._default_max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        self.warn_tools_left_out = True
        self._tools_checked = False  # (whether encode_prompt has checked a chat prompt with tools: tools_left_out)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.stop_token_ids.add(int(tokenizer.eos_token_id))

    @classmethod
    @_named_arguments
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        block_size: int | None = None,
        draft_mode: str = "inject",
        no_draft: bool = False,
        compile: bool = False,
        pack: bool = True,
        fuse: bool | None = None,
        static: bool = False,
        max_context: int | None = None,
        prefill_chunk: int = 256,
        max_batch_size: int | None = None,
        reuse_prefix: bool = True,
        draft_max_batch_size: int | str | None = None,
        prefix_slots: int = 0,
        shared_starts: int = SHARED_STARTS,
        mxfp4: str = "auto",
        fp8: str = "auto",
        int_weights: str = "auto",
        nvfp4: str = "auto",
    ) -> "DFlashEngine":
        """Load a target and a DFlash drafter from local directories or Hugging Face ids (downloaded unless cached).

        Args:
            target: target checkpoint (default: the shipped default target).
            draft: drafter checkpoint (default: the shipped drafter when the target is
                the default one; otherwise required unless ``no_draft``).
            dtype: ``float32``, ``bfloat16`` or ``auto`` (bfloat16 on CUDA, float32 on CPU).
            device: ``cpu``, ``cuda``, ``cuda:N``.
            block_size: tokens per block (default: the drafter's trained block size).
            draft_mode: ``inject`` (persistent drafter KV cache) or ``recompute``.
            no_draft: target-only decoding (``draft`` must then be None).
            pack: on CPU in bfloat16, prepack the linear weights for oneDNN
                (:mod:`dflash_torch.models.packing`; faster eager decoding, a second
                copy of the linear weights in memory; skipped, with a warning logged,
                when that copy would take more than 90% of the free memory).
            fuse: join the projections that read the same rows into one matmul
                (:mod:`dflash_torch.models.fusing`; same outputs); default: on CUDA.
            compile: fixed-shape rounds compiled with ``torch.compile`` (see
                :class:`~dflash_torch.decoding.SpeculativeDecoder`); a graph that torch fails
                to build raises :class:`~dflash_torch.errors.CompileError` where it is built
                (:meth:`warmup`, or the call that first needs it); a compile cache directory
                that torch cannot create (``TORCHINDUCTOR_CACHE_DIR``) raises it when the
                engine is made.
            static: fixed-shape rounds without compiling.
            max_context: longest prompt + generation in tokens (default: the target's
                context: ``max_position_embeddings``, or more under YaRN, see
                :func:`~dflash_torch.options.target_context`); fixed-shape modes preallocate it.
            prefill_chunk: prompt tokens per prefill forward (default 256): larger reads a
                long prompt in fewer forwards, smaller bounds the activations of one (and
                of a joining prompt in a batch round); one above ``max_context`` is taken as
                ``max_context`` (the whole prompt in one forward).
            max_batch_size: sequences decoded together by :meth:`generate_batch`
                (its caches hold ``max_batch_size`` x ``max_context`` positions); default
                8, or 1 with ``draft_mode="recompute"``, which decodes one sequence at a time
                (a larger value is refused there: it would have no effect).
            reuse_prefix: prompt-prefix reuse (default True): in :meth:`generate` / :meth:`stream`,
                of the last request's rows (``SpeculativeDecoder(reuse_prefix=...)``), and in the
                batch decoder (see :class:`~dflash_torch.batch.BatchDecoder`).
            prefix_slots: batch decoder slots that only keep finished sequences' rows for
                prefix reuse, beyond ``max_batch_size`` (default 0: only free slots keep
                them; each costs ``max_context`` positions of cache).
            shared_starts: snapshots of the state where a chat's system messages end that
                the batch decoder keeps for a hybrid or sliding-window target, so that
                conversations sharing a system prompt read only the rest (an integer >= 0,
                default :data:`~dflash_torch.batch.SHARED_STARTS`, 2; 0: none; each costs one
                slot's recurrent state and rings; no effect on other targets; another value
                is refused with ``reuse_prefix`` off or ``draft_mode="recompute"``).
            draft_max_batch_size: batch decoder rounds of more than this many sequences run
                target-only; ``"auto"``: each round drafts or not by measured goodput (see
                :class:`~dflash_torch.batch.BatchDecoder`; default None: always draft). Refused
                where no batched round drafts: with ``no_draft``, ``draft_mode="recompute"``
                (one sequence at a time) or ``block_size=1``.
            mxfp4: MXFP4 expert weights (gpt-oss checkpoints; DeepSeek-V4-Flash's FP4 experts,
                the same numbers): ``"dequantize"`` when
                loading, keep them ``"packed"`` (a quarter of the memory, slower rounds), or
                ``"auto"`` (default): dequantize when they then fit in 90% of the free memory
                (:meth:`TargetModel.from_pretrained <dflash_torch.models.target.TargetModel.from_pretrained>`).
            fp8: the weights of a fine-grained FP8 checkpoint (e.g. Qwen3-8B-FP8):
                ``"dequantize"`` when loading, keep them ``"packed"`` as stored (about half
                of bfloat16's memory; each forward dequantizes what it runs: slower rounds),
                or ``"auto"`` (default): dequantize when they then fit in 90% of the free memory.
            int_weights: the same for the packed integer weights of a compressed-tensors
                W4A16 / W8A16 checkpoint (kept ``"packed"``: about a quarter / half of
                bfloat16's memory).
            nvfp4: the same for the NVFP4 weights of a compressed-tensors
                ``nvfp4-pack-quantized`` or ModelOpt NVFP4 / MIXED_PRECISION checkpoint (kept
                ``"packed"``: 4.5 bits a weight, about 0.28 of bfloat16's memory; the same
                logits, bit for bit; ModelOpt's per-tensor FP8 weights are dequantized in every mode).

        Raises:
            DFlashError: missing files, incompatible pair, bad dtype / device / block size /
                max_context, a yes/no option that is not a bool (see :mod:`dflash_torch.options`;
                checked before any weight is read), ``compile=True`` with
                ``draft_mode="recompute"`` (its shapes grow every round), ``draft_max_batch_size``
                where it has no effect (see above), ``max_batch_size`` > 1 with
                ``draft_mode="recompute"``, ``prefix_slots`` or ``shared_starts`` not an
                integer >= 0 or where they have no effect (see above); a Hub timeout variable (``HF_HUB_ETAG_TIMEOUT``,
                ``HF_HUB_DOWNLOAD_TIMEOUT``) that is not an integer.
            CompileError: ``compile=True`` where torch.compile cannot create its cache directory
                (``TORCHINDUCTOR_CACHE_DIR``: read-only, say).
        """
        from .hub import check_timeouts

        check_timeouts()  # (huggingface_hub's own check, at its import, is a bare ValueError)
        for name, flag in dict(no_draft=no_draft, compile=compile, pack=pack, static=static,
                               reuse_prefix=reuse_prefix).items():
            options.check_flag(flag, name)
        if fuse is not None:
            options.check_flag(fuse, "fuse")
        dev = options.resolve_device(device)
        torch_dtype = options.resolve_dtype(dtype, device=dev)
        for name, path in (("target", target), ("draft", draft)):
            if path is not None and not isinstance(path, (str, os.PathLike)):
                raise OptionError(f"{name} must be a checkpoint directory or a Hugging Face id (a str or a path), "
                                  f"got {path!r}", name)
        if no_draft and draft is not None:
            raise OptionError("no_draft decodes with the target alone; drop draft (or no_draft)", "no_draft", "draft")
        if no_draft and draft_mode == "recompute":  # (as a block size: an option of the drafter)
            raise OptionError("draft_mode 'recompute' needs a drafter (target-only decoding drafts nothing); drop "
                              "draft_mode (or no_draft)", "draft_mode", "draft_mode", "no_draft")
        default_target = target is None
        if default_target:
            target = DEFAULT_TARGET
            if draft is None and not no_draft:
                draft = DEFAULT_DRAFTER
        target_dir = checkpoint_dir(target, "target")
        target_raw = load_config(target_dir)
        target_cfg = TargetConfig.from_dict(target_raw)
        draft_dir, draft_cfg, draft_raw = None, None, None
        if draft is None and not no_draft and not default_target and is_shipped_target(target_dir):
            draft = DEFAULT_DRAFTER  # (the shipped target named by its path: its drafter, as when it is left out)
        if not no_draft:
            if draft is None:
                raise OptionError("this target needs draft, its DFlash drafter checkpoint (or no_draft for "
                                  "target-only decoding)", "draft", "no_draft")
            draft_dir = checkpoint_dir(draft, "draft")
            draft_raw = load_config(draft_dir)
            if needs_mask_token_id(draft_raw):  # (resolved with the target's tokenizer, as SGLang does)
                draft_raw, note = fill_mask_token_id(draft_raw, load_tokenizer(target_dir, target_cfg.vocab_size, "target"),
                                                      target_cfg.vocab_size)
                (log.warning if note.startswith("WARNING: ") else log.info)(f"dflash-torch: {note}")
            try:  # (it named no checkpoint: a ./ORG/NAME copy of a target, loaded before the cached id, baffled)
                draft_cfg = DrafterConfig.from_dict(draft_raw)
            except NotADrafterError as exc:
                raise OptionError(f"draft: {loaded_from(draft, draft_dir)}: {exc}", "draft") from None
            try:
                validate_pair(target_cfg, draft_cfg)
            except DFlashError as exc:
                if not default_target or draft == DEFAULT_DRAFTER:
                    raise
                raise DFlashError(f"{exc} (no target was given, so the shipped default target was used: give the "
                                  "drafter's target)") from None
            if draft_cfg.speculators is not None:
                from .models.speculators import verifier_mismatch

                warning = verifier_mismatch(draft_cfg, target_raw.get("architectures"))
                if warning:
                    log.warning(f"dflash-torch: {warning}")
        options.check_block_size(block_size, draft_cfg.block_size if draft_cfg is not None else None,
                                 context=options.context_limit(target_cfg))
        options.check_max_context(max_context, target_cfg)
        options.check_mxfp4(mxfp4, target_cfg.mxfp4)
        options.check_fp8(fp8, target_cfg.fp8_block is not None, has_mxfp4=target_cfg.mxfp4)
        options.check_int_weights(int_weights, target_cfg.int_quant is not None)
        options.check_nvfp4(nvfp4, target_cfg.nvfp4 not in (None, "modelopt-fp8"),
                            fp8_only=target_cfg.nvfp4 == "modelopt-fp8")
        check_engine_max_batch_size(max_batch_size, drafter=not no_draft, draft_mode=draft_mode)
        check_prefix_slots(prefix_slots, reuse_prefix, draft_mode)
        check_shared_starts(shared_starts, reuse_prefix, draft_mode)
        options.check_count(prefill_chunk, "prefill_chunk")
        check_draft_max_batch_size(draft_max_batch_size, drafter=not no_draft, draft_mode=draft_mode,
                                   block_size=block_size)
        # the weights are read, converted and packed on the compute thread, like every round
        return compute.run(cls._load, target, target_dir, target_cfg, draft_dir, torch_dtype, dev, draft_raw=draft_raw,
                           draft_cfg=draft_cfg, pack=pack, fuse=fuse_by_default(dev) if fuse is None else fuse, mxfp4=mxfp4, fp8=fp8,
                           int_weights=int_weights, nvfp4=nvfp4, block_size=block_size, draft_mode=draft_mode, compile=compile, static=static,
                           max_context=max_context, prefill_chunk=prefill_chunk, max_batch_size=max_batch_size,
                           reuse_prefix=reuse_prefix, draft_max_batch_size=draft_max_batch_size,
                           prefix_slots=prefix_slots, shared_starts=shared_starts)

    @classmethod
    def _load(cls, target, target_dir: Path, target_cfg: TargetConfig, draft_dir: Path | None, torch_dtype: torch.dtype,
              dev: torch.device, *, draft_raw: dict | None, draft_cfg: DrafterConfig | None, pack: bool, fuse: bool, mxfp4: str, fp8: str,
              int_weights: str, nvfp4: str, **engine_options) -> "DFlashEngine":
        tokenizer = load_tokenizer(target_dir, target_cfg.vocab_size, "target")  # (first: before minutes of reading weights)
        eos, recommended, length = [], {}, None  # (generation_config.json's, read before any weight: its errors come first)
        gen_cfg = target_dir / "generation_config.json"
        if gen_cfg.is_file():
            gen = read_json_object(gen_cfg)
            eos = check_vocab_ids(eos_token_ids(gen.get("eos_token_id"), "generation_config.json"),
                                  target_cfg.vocab_size, "generation_config.json")
            try:
                recommended = generation_defaults(gen)
            except DFlashError as exc:  # (refused where it is used: serve --generation-config auto)
                recommended = exc
            try:  # the default length: the file's max_new_tokens alone (taken where another field is bad)
                length = generation_defaults({"max_new_tokens": gen.get("max_new_tokens")}).get("max_new_tokens")
            except DFlashError as exc:  # (refused where the file is read: generation_defaults, serve, chat)
                log.warning(f"dflash-torch: {exc}; it is not taken as a default length (generate without "
                            f"max_new_tokens gives {DEFAULT_MAX_NEW_TOKENS} tokens, cut to the context its prompt "
                            "leaves; serve has its own default)")  # (true for every caller: serve's differs)
        drafter = None if draft_dir is None else DFlashDrafter.from_pretrained(draft_dir, torch_dtype, dev, config=draft_raw,
                                                                                 parsed=draft_cfg)  # (parsed once)
        model = TargetModel.from_pretrained(target_dir, torch_dtype, dev, mxfp4=mxfp4, fp8=fp8, int_weights=int_weights,
                                            nvfp4=nvfp4, parsed=target_cfg)  # (parsed once)
        for option, value, kept in (("mxfp4", mxfp4, model.config.keep_mxfp4), ("fp8", fp8, model.config.keep_fp8),
                                    ("int-weights", int_weights, model.config.keep_int),
                                    ("nvfp4", nvfp4, model.config.keep_nvfp4)):
            if kept and value == "auto":  # (much slower rounds: say so)
                log.warning(f"dflash-torch: the target's quantized weights are kept packed (--{option} auto: "
                            f"dequantized they would not fit in 90% of the free memory); each forward dequantizes "
                            f"them, so rounds are slower")
        if drafter is not None:  # (a Speculators drafter may ship copies of the target's embedding / LM head)
            freed = drafter.share_with(model)
            if freed:
                log.info(f"dflash-torch: the drafter shares the target's embedding / LM head ({freed / 1e6:.0f} MB freed)")
        if fuse:
            fuse_projections(model, query=True)
            if drafter is not None:
                fuse_projections(drafter, query=False)
        if pack and packing_supported(torch_dtype, dev):
            models = [model] if drafter is None else [model, drafter]
            extra, free = sum(packed_bytes(m) for m in models), available_memory(dev)
            if free is not None and extra > 0.9 * free:  # a second copy of the linear weights
                log.warning(f"dflash-torch: not prepacking the linear weights for oneDNN: the packed copies need "
                            f"{memory_text(extra)}, {dev} has {memory_text(free)} free (eager bfloat16 rounds are slower)")
            else:
                for m in models:
                    pack_linears(m)
        # a local directory: its name ("." and "~/x" included: the directory's own, absolute, links kept as given),
        # but a snapshot of the Hugging Face cache (models--ORG--NAME/snapshots/COMMIT) its id, ORG/NAME;
        # a Hugging Face id: as given, as vLLM names it, without an @REVISION (vLLM takes that apart, --revision)
        given = Path(os.path.expanduser(str(target)))
        if given.exists():
            local = Path(os.path.abspath(given))
            name = cached_name(local) or local.name
        else:
            name = str(target).partition("@")[0]
        engine = cls(model, tokenizer, drafter, name=name, **engine_options)
        engine.stop_token_ids.update(eos)
        engine._generation_defaults = recommended
        if length is not None:
            engine.default_max_new_tokens = length
        return engine

    @property
    def generation_defaults(self) -> dict:
        """The sampling the target's ``generation_config.json`` recommends (see the class
        docstring), its ``max_new_tokens`` left out (:attr:`recommended_max_new_tokens`,
        :attr:`default_max_new_tokens`); ``{}`` without the file.

        Raises:
            DFlashError: a value there out of its range or of the wrong type (the message
                names the file and the field); read when loading, refused only here, so
                that an engine that never uses them still runs.
        """
        if isinstance(self._generation_defaults, DFlashError):
            raise DFlashError(str(self._generation_defaults))
        return {k: v for k, v in self._generation_defaults.items() if k != "max_new_tokens"}

    @property
    def default_max_new_tokens(self) -> int:
        """The ``max_new_tokens`` of a request that gives none (tokens), cut to the context
        its prompt leaves (see the class docstring).

        Raises:
            DFlashError: set to anything but an integer >= 1 (a Python or NumPy integer; a float,
                2.0 too, is refused, as ``max_new_tokens`` refuses it).
        """
        return self._default_max_new_tokens

    @default_max_new_tokens.setter
    def default_max_new_tokens(self, value) -> None:
        # (generation_config.json's 8.0 is made 8 where the file is read: sampling.generation_defaults)
        self._default_max_new_tokens = options.check_max_new_tokens(value, "default_max_new_tokens")

    @property
    def recommended_max_new_tokens(self) -> int | None:
        """The target's ``generation_config.json``'s ``max_new_tokens``, None where it sets
        none (the server's limit of a chat request without ``max_tokens``).

        Raises:
            DFlashError: as :attr:`generation_defaults` (the file is refused whole).
        """
        self.generation_defaults  # (raises for a bad file)
        return self._generation_defaults.get("max_new_tokens")

    @property
    def block_size(self) -> int:
        return self.decoder.block_size

    @property
    def max_context(self) -> int:
        """Prompt + generated tokens the target supports."""
        return self.decoder.max_context

    def warmup(self, max_new_tokens: int = 32, batch: bool = False, context: int | None = None) -> float:
        """Run one short greedy generation, then every compiled step at each length bucket
        up to ``context``, so that a compiled engine builds its graphs now rather than in
        the first requests.
        Prompt (up to 8 tokens) and generation (up to ``max_new_tokens``) are cut to fit
        ``max_context``, leaving room for two generated tokens (the first comes from the
        prefill, the second from a decoding round) whenever the context has it.

        Args:
            max_new_tokens: tokens of that generation.
            batch: build the batch decoder's graphs (every batch-size bucket,
                :meth:`BatchDecoder.warmup`), as a server that batches needs, instead of the
                single-sequence decoder's beyond what the short generation builds (such a
                server decodes every request in the batch decoder).
            context: build the graphs of every length bucket that a sequence of up to
                ``context`` tokens reaches (capped at ``max_context``; default 256: the
                first bucket, and the second where rounds near the end of such a sequence
                or a prefill chunk after a reused prefix reach past it): a compiled engine
                then compiles nothing while it decodes such sequences. Each bucket is a
                compile per step (times the batch buckets with ``batch``): about 10 to 30 s
                each on a CPU.

        Returns:
            seconds it took.

        Raises:
            DFlashError: invalid ``max_new_tokens`` or ``context`` (not an integer >= 1), or
                ``batch`` not a bool.
            CompileError: torch failed to build a graph (a damaged compile cache, a C++ compile
                that failed, a cache directory it cannot write, say).
        """
        options.check_max_new_tokens(max_new_tokens)
        options.check_flag(batch, "batch")
        context = 256 if context is None else options.check_count(context, "context")
        t0 = time.perf_counter()
        prompt = [getattr(self.tokenizer, "eos_token_id", None) or 0] * max(1, min(8, self.max_context - 2))
        self.generate(prompt, max_new_tokens=min(max_new_tokens, self.max_context - len(prompt)), ignore_eos=True)
        if batch:
            compute.run(lambda: self.batch_decoder().warmup(context))
        else:  # (every bucket up to context: even a short sequence reaches the second one, where
            # its last rounds pass 256 keys or a reused prefix puts a prefill chunk past them)
            compute.run(lambda: self.decoder.warmup(context))
        return time.perf_counter() - t0

    def encode_prompt(self, prompt: str | list[dict] | list[int], chat: bool = False,
                      chat_template_kwargs: dict | None = None, tools: list[dict] | None = None, *,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      check_length: bool = True) -> list[int]:
        """Token ids of a prompt: text, chat messages (``[{"role", "content"}]``) or ids.

        Chat messages are OpenAI's: ``role`` and ``content`` (a string, or a list of text
        parts ``{"type": "text", "text": str}`` joined by newlines, as the server joins them;
        None or absent for an assistant message with ``tool_calls`` or a ``refusal``: ``""``,
        as the server takes it; an assistant's ``refusal`` string, as OpenAI returns it, is
        text that follows the content's after a newline, as the server reads it), and optionally ``name``,
        ``tool_call_id`` (role ``tool``), ``tool_calls`` (``[{"id", "type": "function",
        "function": {"name", "arguments"}}]``). A call's ``arguments`` given as a JSON
        string (OpenAI's protocol) is parsed into a dict before templating (templates such
        as gpt-oss's and Qwen3-Coder's need a mapping); a dict is taken as is; ``""``, None
        or no ``arguments`` is ``{}`` (as vLLM takes them). A template that cannot render
        the dicts (DeepSeek V3's, V3.1's and R1's join the arguments to a string) gets them
        as JSON text: each call's as sent, a dict's as compact JSON (:func:`~dflash_torch.chat_template.render_chat`).

        A text (or messages' contents, or the messages as the chat template renders them,
        with its markers and tools) longer than :attr:`max_prompt_chars` characters cannot
        fit the context and is refused before it is tokenized (unless ``check_length`` is
        false: to count the tokens of any text, as the server's ``/tokenize`` does).

        Args:
            chat: apply the tokenizer's chat template to a text prompt (messages always get it).
            chat_template_kwargs: extra variables for the chat template, e.g.
                ``{"enable_thinking": False}`` (Qwen3's non-thinking mode, the one the
                published Qwen3 DFlash drafters were trained on) or ``{"reasoning_effort":
                "low"}`` (gpt-oss); see :func:`~dflash_torch.options.check_chat_template_kwargs`.
            tools: the functions the model may call, OpenAI's ``[{"type": "function",
                "function": {"name", "description", "parameters"}}]``, passed to the chat
                template as its ``tools`` (transformers' ``apply_chat_template(tools=...)``);
                None or an empty list: none. A template that leaves them out (renders the
                same prompt without them) gets a WARNING, once per engine (:meth:`tools_left_out`).
            add_generation_prompt: end a chat prompt with the template's opening of the
                assistant's turn (the default; transformers' ``apply_chat_template`` option).
            continue_final_message: end a chat prompt inside its last message instead, so
                that the reply continues that message's text (e.g. an assistant message
                started for the model: "prefill"); needs ``add_generation_prompt=False``
                (transformers' option, vLLM's request field).

        Raises:
            DFlashError: ``chat`` not a bool or without a tokenizer chat template, messages
                the chat template refuses (or a template that cannot be rendered), a message
                of a role OpenAI's API has not that the template drops (:meth:`_check_roles_rendered`), a
                malformed prompt or message (a tool call's ``arguments`` that is not a JSON
                object; an assistant message's call with an ``id`` that no tool message right
                after it answers, or one answered twice, as OpenAI refuses them: the calls
                of a last assistant message are taken with ``continue_final_message``;
                :func:`~dflash_torch.chat_template.unanswered_calls`), or one longer than ``max_prompt_chars``;
                ``chat_template_kwargs`` not a dict of string keys, setting an argument of
                the template call, or given for a prompt that is not a chat; ``tools`` not
                a list of OpenAI's tools (:func:`~dflash_torch.options.check_tools`: e.g. a
                function without a name, or an empty or blank one), or given for a prompt
                that is not a chat;
                ``add_generation_prompt`` / ``continue_final_message`` not bools, both true, or
                ``continue_final_message`` for a prompt that is not a chat.
        """
        options.check_flag(chat, "chat")
        options.check_flag(add_generation_prompt, "add_generation_prompt")
        options.check_flag(continue_final_message, "continue_final_message")
        if add_generation_prompt and continue_final_message:
            raise OptionError("continue_final_message needs add_generation_prompt false: the prompt ends either inside "
                              "the last message or after the opening of a new assistant turn",
                              "continue_final_message", "add_generation_prompt")
        template_kwargs, tools = self._chat_options(chat_template_kwargs, tools)
        given, prompt = prompt, options.as_prompt(prompt)
        if isinstance(prompt, list) and not prompt:
            raise DFlashError("the prompt is empty (no tokens or messages)")
        # token ids: Python or NumPy integers, 0-dim integer tensors (anything with __index__), not bools
        is_ids = isinstance(prompt, list) and all(hasattr(t, "__index__") and not isinstance(t, bool) for t in prompt)
        for name, value in (("chat_template_kwargs", template_kwargs), ("tools", tools),
                            ("continue_final_message", continue_final_message or None)):
            if value and (is_ids or not (chat or isinstance(prompt, list))):  # (an empty one asks nothing: wrappers pass {})
                verb = "applies" if name == "continue_final_message" else "apply"
                raise OptionError(f"{name} {verb} to chat prompts only (chat messages, or a text with chat)", name, "chat")
        if is_ids and chat:
            raise OptionError("chat applies to a text prompt (the chat template is applied to text); this prompt is "
                              "token ids, used as they are: leave chat out, or pass chat messages", "chat")
        if is_ids:
            try:
                return [t.__index__() for t in prompt]
            except TypeError:  # (a 0-dim float tensor has __index__ and refuses it, as a tensor or array of ids does)
                if all(getattr(t, "ndim", 0) == 1 for t in prompt):  # (rows: list(ids) of a tokenizer's batch)
                    rows = given if isinstance(given, tuple) else prompt  # (a tuple as given: "a tuple of ...")
                    raise DFlashError("a prompt list must hold token ids (ints) or chat messages ({'role': str, "
                                      "'content': str})" + _not_messages_hint(rows)) from None
                bad = next(t for t in prompt if not _is_index(t))
                got = shown(bad) if not getattr(bad, "ndim", 0) else \
                    f"{'a tensor' if isinstance(bad, torch.Tensor) else 'an array'} of shape {tuple(bad.shape)}"
                raise DFlashError(f"prompt token ids must be integers, one id each, got {got}") from None
        if isinstance(prompt, list) or chat:
            # (a tuple as given: its error says "a tuple of 2 strings")
            messages = chat_messages((given if isinstance(given, tuple) else prompt) if isinstance(prompt, list)
                                     else [{"role": "user", "content": prompt}],
                                     continue_final_message=continue_final_message)
            if not getattr(self.tokenizer, "chat_template", None):
                raise OptionError("chat cannot be used: this model's tokenizer has no chat template "
                                  "(send a text prompt)", "chat")
            if check_length:
                self._check_length(sum(len(m.get("content") or "") for m in messages))
            if tools is not None:
                template_kwargs = {**(template_kwargs or {}), "tools": tools}
            template_kwargs = {**(template_kwargs or {}), "add_generation_prompt": add_generation_prompt}
            if continue_final_message:
                template_kwargs["continue_final_message"] = True
            text = render_chat(self.tokenizer, messages, template_kwargs)
            self._check_roles_rendered(messages, template_kwargs, text)
            if check_length:  # (what the template adds: each message's markers, the tools, ...)
                self._check_length(len(text), "the prompt (the messages as the chat template renders them)")
            ids = self._encode(text, add_special_tokens=False)
            if tools is not None and self.warn_tools_left_out and not self._tools_checked:
                self._tools_checked = True  # (first: the check renders the prompt again)
                if self.tools_left_out(given, chat, chat_template_kwargs, tools, ids=ids, check_length=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message):
                    log.warning("the chat template leaves out the tools given (it renders the same prompt with and "
                                "without them): the model is not told of them, and calls none (logged once)")
            return ids
        if not isinstance(prompt, str):
            raise DFlashError("the prompt must be a string, a list of token ids, or a list of chat messages"
                              + (options.tokenizer_output_hint(prompt) or f", got {type(prompt).__name__}"))
        if check_length:
            self._check_length(len(prompt))
        return self._encode(prompt)

    def _check_roles_rendered(self, messages: list[dict], template_kwargs: dict, text: str) -> None:
        """Refuses a message of a role OpenAI's API has not (``function``, ``ipython``, ...)
        that the chat template drops (Qwen3's template renders only the roles it knows), so
        that the model would never see it; a template that renders such a role (Llama 3.1's
        ``ipython``) takes it. The messages are rendered once more, each such message's
        content replaced by a short marker of its own (9 characters: a template that renders
        only the start of a content keeps it): a message whose marker is not in that prompt
        (case aside) is dropped (a template that counts the messages renders another prompt
        without one, so the prompt with the message left out tells nothing there; a content
        found elsewhere in the prompt tells nothing either, trial-303). A message of no content, or
        a template that cannot render the markers (it parses the content), is told by the
        prompt without it: the same prompt, dropped. None of this for the usual roles
        (:data:`CHAT_ROLES`).

        Raises:
            DFlashError: naming the message's index and role."""
        odd = [i for i, m in enumerate(messages) if m["role"] not in CHAT_ROLES]
        if not odd:
            return
        tag = secrets.token_hex(3)
        marks = {i: f"m{i}x{tag}" for i in odd}
        marked = [{**m, "content": marks[i]} if i in odd else m for i, m in enumerate(messages)]
        try:
            seen = render_chat(self.tokenizer, marked, template_kwargs).lower()
        except DFlashError:  # (e.g. a template that parses the content of such messages)
            seen = None
        for i in odd:
            content = messages[i]["content"].strip()
            if seen is not None and content:
                dropped = marks[i] not in seen
            else:
                try:
                    dropped = render_chat(self.tokenizer, messages[:i] + messages[i + 1:], template_kwargs) == text
                except DFlashError:  # (the template needs it there: it reads it)
                    dropped = False
            if dropped:
                raise DFlashError(f"chat message {i} has role {shown(messages[i]['role'][:40])}, which this model's "
                                  "chat template does not render (the prompt leaves out the message, so the model "
                                  f"would not see it); the roles are {', '.join(CHAT_ROLES)}")

    def tools_left_out(self, prompt: str | list[dict], chat: bool = False, chat_template_kwargs: dict | None = None,
                       tools: list[dict] | None = None, *, ids: list[int] | None = None, **prompt_options) -> bool:
        """Whether the chat template leaves ``tools`` out of this prompt: renders the same
        token ids with them as without them (a template written without tools: the model is
        not told of them, and calls none). False without tools. :meth:`encode_prompt` checks
        the first chat prompt with tools it renders (where :attr:`warn_tools_left_out`), the
        server its first request's (and logs its own WARNING).

        Args:
            prompt, chat, chat_template_kwargs, tools, prompt_options: as :meth:`encode_prompt`
                takes them (``prompt_options``: its keyword-only options).
            ids: :meth:`encode_prompt`'s token ids of the prompt with the tools, where already
                made (else it is encoded again).

        Raises:
            DFlashError: what :meth:`encode_prompt` raises for these arguments (with the tools;
                a prompt it refuses only without them is one they are not left out of).
        """
        if options.check_tools(tools) is None:
            return False
        if ids is None:
            ids = self.encode_prompt(prompt, chat, chat_template_kwargs, tools, **prompt_options)
        try:
            return ids == self.encode_prompt(prompt, chat, chat_template_kwargs, None, **prompt_options)
        except DFlashError:  # (a template that refuses the prompt without tools: it does not leave them out)
            return False

    def _chat_options(self, chat_template_kwargs: dict | None, tools: list[dict] | None) -> tuple[dict | None, list | None]:
        """:meth:`encode_prompt`'s ``chat_template_kwargs`` and ``tools``, checked (what
        :func:`~dflash_torch.options.check_chat_template_kwargs` and
        :func:`~dflash_torch.options.check_tools` return)."""
        template_kwargs = None if chat_template_kwargs is None else \
            options.check_chat_template_kwargs(chat_template_kwargs, self.reserved_template_variables())
        return template_kwargs, options.check_tools(tools)

    def reserved_template_variables(self) -> list[str]:
        """The named parameters of the tokenizer's ``apply_chat_template``, and ``messages``
        (the variable it renders the conversation as): no extra template variable may take
        these names."""
        return reserved_template_variables(self.tokenizer)

    def _check_length(self, chars: int, what: str = "the prompt") -> None:
        """Refuse ``what``, a text of ``chars`` characters to be tokenized, when it is longer
        than :attr:`max_prompt_chars` (more tokens than the context holds).

        Raises:
            ContextLengthError: as above (the server's 400 ``context_length_exceeded``).
        """
        if chars > self.max_prompt_chars:
            raise ContextLengthError(f"{what} has {chars} characters: more than the context of {self.max_context} "
                                     f"tokens can hold (at most {self.max_prompt_chars} characters with this tokenizer)")

    def _encode(self, text: str, **kwargs) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise DFlashError("the prompt is not valid Unicode text (it contains a lone surrogate)") from None
        return self.tokenizer.encode(text, **kwargs)

    def decode(self, token_ids: list[int], skip: frozenset[int] = frozenset()) -> str:
        """Text of token ids (no space clean-up), special tokens kept except those in ``skip``.

        Args:
            token_ids: a list or tuple of ints (NumPy integers too), or a 1-D NumPy array or
                torch tensor of them.

        Raises:
            DFlashError: ids that are not such a sequence of integers (a bool is not a
                token id), a meta or sparse tensor (no values to read), or an id outside the
                target's vocabulary ``[0, vocab_size)``.
        """
        token_ids = options.plain(token_ids, "token_ids")
        if not isinstance(token_ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int)
                                                           for t in token_ids):
            raise DFlashError(f"token_ids must be a list of integer token ids, got {token_ids!r:.60}")
        return self._decode(token_ids, skip)

    def _decode(self, token_ids: list[int], skip: frozenset[int] = frozenset()) -> str:
        """:meth:`decode` of ids known to be a list of ints (the engine's own: the stopper's
        window every round, :meth:`token_bytes`), without checking their types again.

        Raises:
            DFlashError: an id outside the target's vocabulary ``[0, vocab_size)``.
        """
        bad = [t for t in token_ids if not 0 <= t < self.target.config.vocab_size]
        if bad:
            what = f"{bad[0]}" if -10**20 < bad[0] < 10**20 else f"({shown(bad[0])})"
            raise DFlashError(f"token id {what} is outside the vocabulary [0, {self.target.config.vocab_size})")
        if skip:
            token_ids = [t for t in token_ids if t not in skip]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's special tokens (its named ones, such as EOS, and its added
        tokens marked special): the tokens ``skip_special_tokens`` leaves out of the text."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return frozenset(self.tokenizer.all_special_ids) | {i for i, tok in added.items() if getattr(tok, "special", False)}

    @functools.cached_property
    def byte_token_values(self) -> dict[int, int]:
        """A byte-fallback (SentencePiece-style) vocabulary's byte tokens ``<0x00>`` ..
        ``<0xFF>`` -> the byte each stands for (``<0xE9>``: 0xE9; empty in a byte-level BPE
        vocabulary): a run of them decodes as one, valid UTF-8 or one U+FFFD per byte, so the
        output text takes a run when it ends, counted by these values
        (:class:`~dflash_torch.stopping.IncrementalText`)."""
        names = [f"<0x{b:02X}>" for b in range(256)]
        ids = self.tokenizer.convert_tokens_to_ids(names)
        return {i: b for b, (name, i) in enumerate(zip(names, ids)) if isinstance(i, int)
                and i != self.tokenizer.unk_token_id and self.tokenizer.convert_ids_to_tokens(i) == name}

    @functools.cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """The ids of :attr:`byte_token_values`."""
        return frozenset(self.byte_token_values)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (the ``bytes`` of OpenAI's logprobs).

        Byte-level BPE tokenizers (Qwen, Llama 3): the token's bytes, which may hold part of
        a multi-byte UTF-8 character (its text alone would be U+FFFD). A byte-fallback
        vocabulary's byte token ``<0xNN>`` (Llama 2, Gemma): its one byte. Another token of
        the vocabulary: the text it adds after a plain word, so a SentencePiece word-start
        piece ``▁the`` is ``b" the"`` (decoded alone, its space is dropped as at the start
        of a text). Added tokens: the UTF-8 of :meth:`decode` of the token alone.

        Raises:
            DFlashError: ``token_id`` is not an integer in ``[0, vocab_size)``.
        """
        vocab = self.target.config.vocab_size
        try:
            valid = not isinstance(token_id, bool) and 0 <= operator.index(token_id) < vocab
        except TypeError:
            valid = False
        if not valid:  # (a huge one was an OverflowError of the tokenizer)
            raise DFlashError(f"token_id must be a token id, an integer in [0, {vocab}), got {shown(token_id)}")
        token_id = operator.index(token_id)
        if token_id in self.tokenizer.added_tokens_decoder:
            return self._decode([token_id]).encode("utf-8")
        if self._byte_values is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_values for c in piece):
                return bytes(self._byte_values[c] for c in piece)
        elif token_id in self.byte_token_ids:
            return bytes([self.byte_token_values[token_id]])
        elif self._anchor is not None:
            anchor, anchor_text = self._anchor
            text = self._decode([*anchor, token_id])
            if text.startswith(anchor_text):
                return text[len(anchor_text):].encode("utf-8")
        return self._decode([token_id]).encode("utf-8")

    @functools.cached_property
    def _anchor(self) -> tuple[list[int], str] | None:
        """The tokens of a plain word and their text, after which :meth:`token_bytes` reads
        the text another token adds (None where the tokenizer does not read "a" back)."""
        ids = self.tokenizer.encode("a", add_special_tokens=False)
        text = self._decode(ids) if ids and not set(ids) & set(self.tokenizer.added_tokens_decoder) else ""
        return (ids, text) if text.strip() == "a" else None

    def token_text(self, token_id: int) -> str:
        """:meth:`token_bytes` as a string: UTF-8, bytes that are not valid UTF-8 on their own
        (part of a character) written ``\\xNN`` (the ``token`` of OpenAI's logprobs)."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The compiler of this engine's structured-output constraints (the target's tokenizer,
        vocabulary, EOS ids and special tokens; compiled constraints cached)."""
        return GrammarCompiler(self.tokenizer, self.target.config.vocab_size, sorted(self.stop_token_ids),
                               sorted(self.special_token_ids))

    @functools.cached_property
    def _byte_values(self) -> dict[str, int] | None:
        """A byte-level BPE vocabulary's character -> byte map (None for other tokenizers)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        return {c: b for b, c in enumerate(byte_level_alphabet())}

    def generate(self, prompt, *, on_chunk: Callable[[StreamChunk], None] | None = None, **kwargs) -> GenerationResult:
        """Generate to completion; arguments as :meth:`stream`. Returns a :class:`GenerationResult`.

        The whole generation is one call on the compute thread (no hand-off per round).
        ``on_chunk``, if given, is called there with each :class:`StreamChunk` as its round
        commits it; an exception it raises stops the generation and is raised here. It
        must not call the engine (such a call raises :class:`DFlashError`).
        """
        _check_arguments("DFlashEngine.generate", kwargs, DFlashEngine.stream)
        _check_printable(DFlashEngine.stream, self, prompt, **kwargs)
        if on_chunk is not None and not callable(on_chunk):
            raise OptionError(f"on_chunk must be a function of a StreamChunk (or None), got {type(on_chunk).__name__}",
                              "on_chunk")
        with self._request(prompt, **kwargs) as chunks:
            return compute.run(self._collect, chunks, on_chunk)

    @classmethod
    def _collect(cls, chunks: Iterator[StreamChunk], on_chunk) -> GenerationResult:
        got = []
        for chunk in chunks:
            if on_chunk is not None:
                on_chunk(chunk)
            got.append(chunk)
            if compute.interrupted():  # the caller got Ctrl-C (or the process exits): stop after this round
                raise compute.stopped()
        return cls._result(got)

    @staticmethod
    def _result(chunks: list[StreamChunk]) -> GenerationResult:
        """The result of a request's chunks, the last one with its ``finish_reason``."""
        last = chunks[-1]
        logprobs = None if last.logprobs is None else [lp for c in chunks for lp in c.logprobs]
        return GenerationResult("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                                last.finish_reason, last.stats, logprobs, chunks[0].prompt_logprobs)

    @_named_arguments
    def stream(
        self,
        prompt: str | list[dict] | list[int],
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: int | Sequence[int] | None = None,
        ignore_eos: bool = False,
        chat: bool = False,
        logprobs: int | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        structured_output: StructuredOutput | dict | None = None,
        prompt_logprobs: int | None = None,
        skip_special_tokens: bool = False,
        include_stop_str_in_output: bool = False,
        history_end: int | None = None,
    ) -> Iterator[StreamChunk]:
        """Generate, yielding text deltas as rounds commit tokens.

        Args:
            prompt: text, chat messages, or token ids.
            max_new_tokens: at most this many generated tokens (>= 1); a prompt plus this
                many tokens must fit :attr:`max_context`. None (default):
                :attr:`default_max_new_tokens` (``generation_config.json``'s ``max_new_tokens``,
                else 256), cut to the context the prompt leaves (as the server cuts a
                request's default).
            temperature, top_k, top_p, min_p, seed: see :class:`SamplingParams`.
            presence_penalty, frequency_penalty, repetition_penalty: see :class:`SamplingParams`
                (0, 0, 1 = off); speculative decoding stays lossless with them.
            logit_bias: token id -> bias in [-100, 100], added to the target's logits
                (OpenAI's ``logit_bias``; see :class:`SamplingParams`); ids in [0, vocab size).
            min_tokens: the first ``min_tokens`` tokens (<= ``max_new_tokens``, or without it
                <= the default cut to the context) cannot be a stop
                token (EOS unless ``ignore_eos``, ``stop_token_ids``: masked), and stop strings
                completed within them do not count (vLLM's ``min_tokens``).
            stop: stop string(s): generation ends after the first token that completes
                one, and the text is cut at the start of that occurrence.
            stop_token_ids: an extra stop token id or a list of them (a tuple, set, ``range``,
                1-D array or tensor too), in [0, vocab size) (EOS ids are included unless ``ignore_eos``).
            ignore_eos: do not stop at the model's EOS tokens.
            skip_special_tokens: leave special tokens (:attr:`special_token_ids`: EOS, chat
                markers, the mask token, ...) out of the text (vLLM's option; its default
                is true, this one's false, as transformers' ``decode``); the token ids keep them.
                Stop strings are looked for in the text as it is returned.
            include_stop_str_in_output: keep the stop string that ended the output in its
                text (vLLM's option): the text is cut after it instead of before.
            chat: apply the tokenizer's chat template to a text prompt.
            chat_template_kwargs: extra chat template variables (see :meth:`encode_prompt`).
            tools: functions the model may call, for the chat template (see :meth:`encode_prompt`);
                the reply is the model's text (the server parses its tool calls).
            structured_output: constrain the output to a JSON schema, any JSON object, a regex,
                a choice of strings or a Lark grammar: a
                :class:`~dflash_torch.structured.StructuredOutput` or its dict form
                (``{"json": schema}``, ``{"json_object": True}``, ``{"regex": r"..."}``,
                ``{"choice": [...]}``, ``{"grammar": "start: ..."}``). At every position the
                target's tokens that would leave the constraint get -inf; speculative decoding
                stays lossless for that constrained target, and the drafter proposes only
                valid continuations. Not with ``ignore_eos`` or ``min_tokens`` (the constraint
                decides where the output ends). An output that reaches ``max_new_tokens`` where
                the constraint is complete and allows only the EOS ends with ``finish_reason``
                ``"stop"``, as if the EOS had followed (it is not in the token ids).
            logprobs: None (default) or k in [0, 20]: each chunk carries the target's
                log-probability of each of its tokens and the k most likely tokens at
                that position (``StreamChunk.logprobs``; see :class:`GenerationResult`).
                The tokens are the same with or without.
            prompt_logprobs: None (default) or k in [0, 20]: the first chunk carries the
                log-probability of each prompt token under the target, given the tokens
                before it, and the k most likely tokens there (``StreamChunk.prompt_logprobs``;
                see :class:`GenerationResult`), taken from the logits the prefill computes
                anyway (no extra forward). The tokens are the same with or without.
            history_end: None (default) or a position in ``(0, len(prompt)]`` of a token-id
                prompt rendered from chat messages: where its messages end, before the
                template's opening of the reply (:meth:`history_end`, which a prompt given as
                messages gets by itself). A hybrid or sliding-window model keeps its
                prefix-reuse copies there, so that the next turn of the chat reuses the
                history even where the template renders this reply otherwise. The tokens
                are the same with or without.

        Yields:
            :class:`StreamChunk`; the last one has ``finish_reason`` and ``stats``.

        Raises:
            DFlashError: invalid parameters or a prompt that does not fit the context, at the
                first ``next()`` (this is a generator: calling it checks nothing; the request
                is checked, and waits for the engine, when iteration starts).
        """
        with self._request(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p, seed=seed, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                           repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_tokens=min_tokens,
                           stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, chat=chat,
                           logprobs=logprobs, chat_template_kwargs=chat_template_kwargs, tools=tools,
                           structured_output=structured_output, prompt_logprobs=prompt_logprobs,
                           skip_special_tokens=skip_special_tokens,
                           include_stop_str_in_output=include_stop_str_in_output, history_end=history_end) as chunks:
            # each round runs on the compute thread (see dflash_torch.compute), whichever
            # thread iterates this stream
            while True:
                self._readers.add(threading.current_thread())  # (a pool's threads may take turns)
                self._reading = True
                try:
                    chunk = compute.run(next, chunks, None)
                finally:
                    self._reading, self._read_at, self._stream_open = False, time.monotonic(), True
                if chunk is None:
                    return
                if chunk.finish_reason is not None:
                    break  # (the last chunk: the engine is freed before it is handed over)
                yield chunk
        yield chunk

    # (what help() and inspect show of generate: stream's arguments and on_chunk, not **kwargs)
    generate.__signature__ = _signature_of_generate(generate, stream)

    @contextlib.contextmanager
    def _request(self, prompt, *, max_new_tokens: int | None = None, chat: bool = False,
                 chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                 prompt_logprobs: int | None = None, history_end: int | None = None,
                 **sampling) -> Iterator[Iterator[StreamChunk]]:
        """Check a request, tokenize its prompt, take the engine (see the class docstring) and
        give the request's chunks, to be pulled on the compute thread; frees the engine on exit.
        ``sampling``: the sampling and stop arguments of :meth:`stream` (see :meth:`request_params`).
        NumPy values are taken as the numbers they hold (:func:`~dflash_torch.options.plain`)."""
        max_new_tokens, prompt_logprobs, history_end = (options.plain(value, name) for value, name in (
            (max_new_tokens, "max_new_tokens"), (prompt_logprobs, "prompt_logprobs"), (history_end, "history_end")))
        sampling = {name: options.plain(value, name) for name, value in sampling.items()}
        params, stopper = self.request_params(self._unfitted(max_new_tokens, sampling.get("min_tokens", 0)), **sampling)
        options.check_prompt_logprobs(prompt_logprobs)
        prompt_ids = self.encode_prompt(prompt, chat, chat_template_kwargs, tools)
        if max_new_tokens is None:
            stopper.max_new_tokens = self._default_limit(prompt_ids, params.min_tokens)
        if history_end is None:
            checkpoint = self.history_end(prompt, prompt_ids, chat, chat_template_kwargs, tools)
        else:
            checkpoint = options.check_prompt_position(history_end, len(prompt_ids), "history_end", counted=True)
        with self._locked():  # other threads wait their turn
            chunks = self._stream(prompt_ids, params, stopper, prompt_logprobs, checkpoint)
            try:
                yield chunks
            finally:
                try:
                    compute.run(chunks.close)
                finally:  # (even when a Ctrl-C interrupts the close)
                    self._readers, self._stream_open = weakref.WeakSet(), False

    def _unfitted(self, max_new_tokens: int | None, min_tokens) -> int:
        """``max_new_tokens`` to check a request's options with before its prompt is known:
        the given one, else :attr:`default_max_new_tokens` (cut to the context once the
        prompt is known: :meth:`_default_limit`).

        Raises:
            OptionError: without ``max_new_tokens``, a ``min_tokens`` above the default (named
                as such: the default is no value the caller gave).
        """
        if max_new_tokens is not None:
            return max_new_tokens
        options.check_min_tokens_default(min_tokens, self.default_max_new_tokens)
        return self.default_max_new_tokens

    def _default_limit(self, prompt_ids: list[int], min_tokens: int) -> int:
        """The ``max_new_tokens`` of a request that gave none: :attr:`default_max_new_tokens`
        cut to the context ``prompt_ids`` leave (as the server cuts its default).

        Raises:
            DFlashError: bad prompt ids, or a prompt that leaves no room for a token
                (:func:`~dflash_torch.options.check_prompt_ids`, as with any ``max_new_tokens``).
            OptionError: a ``min_tokens`` above the tokens left after the prompt, named so.
        """
        n = options.check_prompt_ids(prompt_ids, self.target.config, 1, self.max_context)
        return min(self.default_max_new_tokens, options.check_min_tokens_room(min_tokens, n, self.max_context))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the engine's lock, waiting while another request holds it (while an open stream
        holds it and no thread has read it for ``COLLECT_AFTER_S`` seconds, the garbage
        collector runs, once each time the stream stops, and then every ``STALLED_STREAM_S``
        seconds: a stream that only a reference cycle keeps then closes; in a thread that has
        read the open stream, it runs once as soon as no thread reads it, before any wait).
        A thread that has not read it waits on, with one WARNING (logger ``dflash_torch``)
        once the stream has not been read for ``STALLED_STREAM_S`` seconds after a collection.

        Raises:
            DFlashError: on the compute thread while another request holds the lock (an
                ``on_chunk`` callback that calls its engine): that request needs the
                compute thread to end, so waiting for it would never end. In a thread that
                has read the open stream, where no thread has read it for
                ``STALLED_STREAM_S`` seconds (if only this thread reads it, it waits on this
                thread, which waits on it). In a forked child, on an engine whose parent ran
                a request when the process forked (its state is that request's, halfway).
        """
        if self._forked_busy:
            raise DFlashError("this engine was running a request in the parent process when the process forked, so "
                              "this copy holds that request's state halfway; load a new engine in the child (or fork "
                              "while no request runs)")
        if compute.on_compute_thread():
            if not self.lock.acquire(blocking=False):
                raise DFlashError("this engine is busy with another request (an open stream, or the request whose "
                                  "on_chunk runs this code), and code on the compute thread (on_chunk, compute.run) "
                                  "must not call the engine: that request needs the compute thread, so it cannot be "
                                  "waited for; call the engine from another thread (an open stream: close() it first)")
        else:
            swept = False
            while threading.current_thread() in self._readers:
                if self.lock.acquire(timeout=0.05):
                    break
                if self._reading:
                    continue
                if not swept:
                    # a stream that only a reference cycle keeps (through an exception's traceback that a
                    # local holds, say) closes when the cycle is collected: then this thread reads it no more
                    gc.collect()
                    swept = True
                elif time.monotonic() - self._read_at >= STALLED_STREAM_S:
                    raise DFlashError(f"another stream of this engine is still open, this thread has read it, and no "
                                      f"thread has read it for {STALLED_STREAM_S:g} s; consume it to the end or close() "
                                      "it before starting a new request from this thread (a stream held by a variable "
                                      "stays open, through an exception's traceback too: `with contextlib.closing("
                                      "engine.stream(...)) as chunks:` closes it), or raise "
                                      "dflash_torch.engine.STALLED_STREAM_S for a stream that other threads read slowly; "
                                      "an asyncio app that reads streams with run_in_executor needs an executor with "
                                      "more threads than engine calls at once")
            else:  # (another thread reads the stream, or holds the engine: wait for it)
                collected, collected_for, warned = time.monotonic(), None, False
                while not self.lock.acquire(timeout=0.25):
                    if self._reading:
                        continue
                    now = time.monotonic()
                    unread = now - self._read_at
                    # (an open stream that has not moved for COLLECT_AFTER_S: once for each time it stopped)
                    stopped = self._stream_open and unread >= min(COLLECT_AFTER_S, STALLED_STREAM_S)
                    if (stopped and collected_for != self._read_at) or min(unread, now - collected) >= STALLED_STREAM_S:
                        # a stream that only a reference cycle keeps (through an exception's traceback, say:
                        # a web framework's abandoned response to a client that left) closes when the cycle is
                        # collected; in a program whose other threads all wait, nothing else would run the
                        # collector: this wait never ended (and with it only every STALLED_STREAM_S, each
                        # client that left held the engine that long)
                        gc.collect()
                        collected, collected_for = time.monotonic(), self._read_at
                    if (not warned and self._stream_open and collected_for == self._read_at
                            and time.monotonic() - self._read_at >= STALLED_STREAM_S):
                        warned = True  # (a stream that a variable or a kept traceback holds: it waits for that)
                        log.warning(f"dflash-torch: WARNING: a request waits for a stream of this engine that is "
                                    f"still open and has not been read for {STALLED_STREAM_S:g} s; the engine serves "
                                    "the next request once it is read to the end or close()d (a stream held by a "
                                    "variable, or by an exception's traceback, e.g. of a cancelled asyncio task "
                                    "that read it, stays open: `with contextlib.closing(engine.stream(...)) as "
                                    "chunks:` closes it)")
        try:
            yield
        finally:
            self.lock.release()

    def history_end(self, prompt, prompt_ids: list[int], chat: bool = False,
                    chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> int | None:
        """Where a chat prompt's messages end in its token ids, before the template's opening
        of the reply: the ``history_end`` of :meth:`stream` (the decoders' ``checkpoint``,
        see :meth:`SpeculativeDecoder.rounds`), where the next turn's prompt starts over
        from even where the template renders the reply otherwise than it was generated.

        Args:
            prompt, chat, chat_template_kwargs, tools: as :meth:`encode_prompt` took them.
            prompt_ids: :meth:`encode_prompt`'s token ids of that prompt (with the generation prompt).

        Returns:
            the number of tokens of the messages rendered without the generation prompt,
            where those tokens start ``prompt_ids`` and are fewer, and the template renders
            the reply otherwise in the next turn: the messages, a reply and a next user
            message rendered do not start with ``prompt_ids`` (a reasoning model's
            history without its thinking); at most the tokens ``prompt_ids`` shares with
            that next turn (where the messages' last token merges with the opening of the
            reply, a newline with a newline, or the next turn renders the messages' end
            otherwise). None where they do (ChatML without thinking:
            the prompt's own end serves the next turn, with its opening of the reply), for
            a prompt that is not a chat, where the renderings do not start ``prompt_ids``
            (or the template cannot render them), and on a model that keeps no
            prefix-reuse copies (attention targets: their rows serve any common start;
            prefix reuse off), where it would serve nothing (not rendered then).
        """
        takes = self.decoder.takes_checkpoint or (self._batch is not None and self._batch.takes_checkpoint)
        if not takes or not (chat or (
                isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt))):
            return None
        messages = prompt if isinstance(prompt, (list, tuple)) else [{"role": "user", "content": prompt}]
        probe = [{"role": "assistant", "content": "OK."}, {"role": "user", "content": "And?"}]  # (a next turn)
        try:
            history = self.encode_prompt(prompt, chat, chat_template_kwargs, tools, add_generation_prompt=False,
                                         check_length=False)
            following = self.encode_prompt(list(messages) + probe, chat, chat_template_kwargs, tools,
                                           add_generation_prompt=False, check_length=False)
        except DFlashError:  # (a template that cannot end without the opening, or refuses the probe)
            return None
        if following[:len(prompt_ids)] == prompt_ids:  # (the next turn renders this prompt again: its end serves)
            return None
        # (the messages' end, or where their last token merged with the opening of the reply, a newline with a
        # newline, and where the next turn renders that end otherwise, "\n\n" of a message's "\n" and "\n#" of a
        # reply's opening, the last position this prompt shares with both the messages and the next turn rendered)
        n = min(common_start(history, prompt_ids), common_start(following, prompt_ids))
        return n if 0 < n < len(prompt_ids) else None

    def shared_end(self, prompt, prompt_ids: list[int], chat: bool = False,
                   chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> int | None:
        """Where a chat prompt's leading system (or developer) messages end in its token ids,
        with the tools where the template renders them there: a start other conversations
        with that system prompt and tools share, which the batch decoder (``shared_end`` of
        :meth:`BatchDecoder.add <dflash_torch.batch.BatchDecoder.add>`) keeps a snapshot of on
        a hybrid or sliding-window model, so that their prompts read only the rest
        (:meth:`generate_batch` and the server give it; one sequence at a time, a prompt reuses
        only the last request's rows).

        Args:
            prompt, chat, chat_template_kwargs, tools: as :meth:`encode_prompt` took them.
            prompt_ids: :meth:`encode_prompt`'s token ids of that prompt.

        Returns:
            the number of tokens ``prompt_ids`` shares from its start with those messages
            rendered alone (without a generation prompt; where the template refuses that,
            with those messages followed by a user message, two different ones), where that is at least
            :data:`SHARED_START_MIN` and fewer than ``prompt_ids``; None for a prompt that is
            not a chat of messages, one with no leading system message, a template that cannot
            render those messages alone, a shorter start, and on a model whose batch decoder
            keeps no such snapshots (attention targets: their rows serve any common start;
            prefix reuse off; ``draft_mode="recompute"``), where it would serve nothing (not
            rendered then).
        """
        batch = self._batch  # (one that keeps snapshots: shared_starts 0 keeps none, and the renders would serve nothing)
        takes = (batch.takes_checkpoint and batch.shared_starts > 0 if batch is not None
                 else self.batched and self.decoder.takes_checkpoint and self.shared_starts > 0)
        if not takes or not isinstance(prompt, (list, tuple)) or not prompt or not all(isinstance(m, dict) for m in prompt):
            return None
        leading = []
        for message in prompt:
            if message.get("role") not in ("system", "developer"):
                break
            leading.append(message)
        if not leading:
            return None
        def render(messages: list[dict]) -> list[int]:
            return self.encode_prompt(messages, chat, chat_template_kwargs, tools, add_generation_prompt=False,
                                      check_length=False)

        try:
            renders = [render(leading)]
        except DFlashError:  # (a template that renders no conversation without a user message, as Qwen3's:
            try:  # the start two different user messages after them share)
                renders = [render(leading + [{"role": "user", "content": text}]) for text in ("A", "Z")]
            except DFlashError:
                return None
        n = min(common_start(rendered, prompt_ids) for rendered in renders)
        return n if SHARED_START_MIN <= n < len(prompt_ids) else None

    def _stream(self, prompt_ids, params, stopper: Stopper, prompt_logprobs: int | None = None,
                checkpoint: int | None = None) -> Iterator[StreamChunk]:
        stats = GenerationStats(prompt_tokens=len(prompt_ids), block_size=self.block_size,
                                draft_mode=self.decoder.draft_mode if self.drafter is not None else None)
        stopper.start(prompt_ids)
        rounds = self.decoder.rounds(prompt_ids, params, stopper.max_new_tokens, prompt_logprobs, checkpoint)
        # (until it ends, another caller's rounds() is refused: it took over the caches between two chunks)
        self.decoder.hold(rounds, "an open request (generate, stream) of its DFlashEngine")
        try:
            for rnd in rounds:
                chunk = self.record_round(rnd, stats, stopper)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            self.decoder.hold(None)
            rounds.close()

    @classmethod
    def record_round(cls, rnd: Round, stats: GenerationStats, stopper: Stopper) -> StreamChunk:
        """Account one committed :class:`Round` of a request: its stats and the chunk it streams
        (with ``finish_reason`` and the finished ``stats`` when the stopper ends the request).

        Raises:
            DFlashError: the round reports an error for its sequence (:attr:`Round.error`: its
                structured-output constraint cannot go on)."""
        if rnd.error is not None:  # (this sequence only: e.g. its structured-output constraint cannot go on)
            raise DFlashError(f"structured output failed: {rnd.error}")
        text, kept, finish = stopper.feed(rnd.tokens)
        if finish == "length" and rnd.complete_after == kept:  # (only the EOS could follow: the constraint ended it)
            finish = "stop"
        if rnd.acceptance_length is None:
            stats.prefill_time = rnd.total_time
            stats.cached_prompt_tokens = rnd.cached_tokens
        else:  # (the last round: the tokens kept, not those past max_new_tokens or a stop)
            stats.acceptance_lengths.append(kept if finish else rnd.acceptance_length)
            stats.propose_times.append(rnd.propose_time)
            stats.verify_times.append(rnd.verify_time)
            stats.decode_time += rnd.total_time
        logprobs = rnd.logprobs[:kept] if rnd.logprobs is not None else None
        if finish:
            stats.generated_tokens = stopper.generated
            cls._finish_stats(stats)
            return StreamChunk(text, rnd.tokens[:kept], finish, stats, logprobs, rnd.prompt_logprobs)
        return StreamChunk(text, rnd.tokens, logprobs=logprobs, prompt_logprobs=rnd.prompt_logprobs)

    # --- many requests at once ---

    @property
    def batched(self) -> bool:
        """Whether :meth:`generate_batch` and the server decode several sequences per round
        (:meth:`batch_decoder`); False with ``draft_mode="recompute"``, whose cache-less
        drafter decodes one sequence at a time."""
        return self.drafter is None or self.decoder.draft_mode != "recompute"

    def batch_decoder(self) -> BatchDecoder:
        """The engine's :class:`~dflash_torch.batch.BatchDecoder` (``max_batch_size`` slots,
        the engine's block size, ``max_context``, prefill chunk and fixed-shape / compile
        settings, its ``compile_backend`` included), created on the first call; call it and drive it on the compute thread
        (:func:`dflash_torch.compute.run`). :meth:`generate_batch` decodes with it too, and
        refuses to while it holds sequences added here.

        Raises:
            DFlashError: caches that do not fit (see ``BatchDecoder``), or an engine that is
                not :attr:`batched` (the batch decoder drafts with the injected cache only).
        """
        if not self.batched:
            raise OptionError("draft_mode 'recompute' decodes one sequence at a time; the batch decoder drafts with "
                              "'inject'", "draft_mode")
        if self._batch is None:
            self._batch = BatchDecoder(self.target, self.drafter, block_size=self.block_size,
                                       max_batch_size=self.max_batch_size, max_context=self._max_context_option,
                                       prefill_chunk=self.decoder.prefill_chunk, static=self.decoder.static,
                                       compile=self.decoder.compiled, compile_backend=self._compile_backend,
                                       reuse_prefix=self.reuse_prefix,
                                       draft_max_batch_size=self.draft_max_batch_size, prefix_slots=self.prefix_slots,
                                       shared_starts=self.shared_starts)
        return self._batch

    def request_params(self, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0, seed: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                       min_tokens: int = 0, stop=None, stop_token_ids=None, ignore_eos: bool = False,
                       logprobs: int | None = None,
                       structured_output: StructuredOutput | dict | None = None,
                       skip_special_tokens: bool | frozenset[int] = False,
                       include_stop_str_in_output: bool = False) -> tuple[SamplingParams, Stopper]:
        """A request's checked :class:`SamplingParams` and :class:`~dflash_torch.stopping.Stopper`,
        as :meth:`stream` makes them (arguments as there): the params' ``min_tokens_ids`` are
        the stopper's stop token ids.

        Raises:
            DFlashError: an invalid value (a logit_bias id outside the vocabulary included;
                see :meth:`new_stopper`), an invalid structured output (schema, regex, grammar)
                or one with ``ignore_eos``.
        """
        grammar = None
        if structured_output is not None:
            if ignore_eos is True:
                raise OptionError("ignore_eos cannot be combined with a structured output: the output ends with EOS "
                                  "where the constraint is complete", "ignore_eos", "structured_output")
            grammar = self.grammars.compile(structured_output)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                repetition_penalty=repetition_penalty, logit_bias=logit_bias, min_tokens=min_tokens,
                                logprobs=logprobs, grammar=grammar)
        params.check_vocab(self.target.config.vocab_size)
        stopper = self.new_stopper(max_new_tokens, stop, stop_token_ids, ignore_eos, params.min_tokens,
                                   skip_special_tokens, include_stop_str_in_output)
        if params.min_tokens:
            params = replace(params, min_tokens_ids=frozenset(stopper.stop_ids))
        return params, stopper

    def new_stopper(self, max_new_tokens: int, stop=None, stop_token_ids=None, ignore_eos: bool = False,
                    min_tokens: int = 0, skip_special_tokens: bool | frozenset[int] = False,
                    include_stop_str_in_output: bool = False) -> Stopper:
        """A checked :class:`~dflash_torch.stopping.Stopper` of one request, as :meth:`stream` makes it.

        ``skip_special_tokens``: True leaves every special token (:attr:`special_token_ids`)
        out of the text; a set of ids, all special tokens but those (the server keeps the
        markers its reply parsers read).

        Raises:
            DFlashError: invalid ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
                ``skip_special_tokens`` or ``include_stop_str_in_output`` (not bools),
                ``min_tokens`` above ``max_new_tokens``, or ``min_tokens`` with stop token ids
                (``stop_token_ids`` and EOS) that cover the whole vocabulary (no token to generate).
        """
        options.check_max_new_tokens(max_new_tokens)
        options.check_flag(ignore_eos, "ignore_eos")
        options.check_flag(include_stop_str_in_output, "include_stop_str_in_output")
        if isinstance(skip_special_tokens, frozenset):
            skip = self.special_token_ids - skip_special_tokens
        else:
            options.check_flag(skip_special_tokens, "skip_special_tokens")
            skip = self.special_token_ids if skip_special_tokens else frozenset()
        if min_tokens > max_new_tokens:
            raise OptionError(f"min_tokens ({min_tokens}) must be at most max_new_tokens ({max_new_tokens})",
                              "min_tokens", "max_new_tokens")
        stops = options.check_stop(stop)
        stop_ids = set() if ignore_eos else set(self.stop_token_ids)
        stop_ids.update(options.check_stop_token_ids(stop_token_ids, self.target.config.vocab_size))
        vocab = self.target.config.vocab_size
        if min_tokens and covers_vocab(stop_ids, vocab):  # (min_tokens masks them all)
            raise OptionError(f"min_tokens ({min_tokens}) holds back every stop token id until then, and the stop "
                              f"token ids (stop_token_ids and EOS) cover the whole vocabulary ({vocab} ids): no token is "
                              "left to generate; drop min_tokens or some stop_token_ids", "min_tokens", "stop_token_ids")
        decode = functools.partial(self._decode, skip=skip) if skip else self._decode
        return Stopper(decode, stops, stop_ids, max_new_tokens, min_tokens, include_stop_str_in_output,
                       self.byte_token_values)

    @_named_arguments
    def generate_batch(
        self,
        prompts: Sequence[str | list[dict] | list[int]],
        *,
        max_new_tokens: int | None | Sequence[int | None] = None,
        temperature: float | Sequence[float] = 0.0,
        top_k: int | Sequence[int] = 0,
        top_p: float | Sequence[float] = 1.0,
        min_p: float | Sequence[float] = 0.0,
        seed: int | None | Sequence[int | None] = None,
        presence_penalty: float | Sequence[float] = 0.0,
        frequency_penalty: float | Sequence[float] = 0.0,
        repetition_penalty: float | Sequence[float] = 1.0,
        logit_bias: dict[int, float] | None | Sequence[dict[int, float] | None] = None,
        min_tokens: int | Sequence[int] = 0,
        stop: str | Sequence[str] | Sequence[str | Sequence[str] | None] | None = None,
        stop_token_ids: int | Sequence[int] | Sequence[int | Sequence[int] | None] | None = None,
        ignore_eos: bool | Sequence[bool] = False,
        chat: bool = False,
        logprobs: int | None | Sequence[int | None] = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        structured_output: StructuredOutput | dict | None | Sequence[StructuredOutput | dict | None] = None,
        prompt_logprobs: int | None | Sequence[int | None] = None,
        skip_special_tokens: bool | Sequence[bool] = False,
        include_stop_str_in_output: bool | Sequence[bool] = False,
    ) -> list[GenerationResult]:
        """Generate for many prompts at once: up to ``max_batch_size`` sequences per
        decoding round; a finished one leaves at a round boundary and the next prompt
        takes its slot (an engine that is not :attr:`batched`, ``draft_mode="recompute"``,
        decodes them one after another). Each result equals what :meth:`generate` gives for that prompt
        alone with the same arguments (greedy: the same tokens; sampling: the same tokens
        for the same seed, up to float rounding of the batched forwards).

        Args:
            prompts: a non-empty list of prompts (text, chat messages, or token ids).
            max_new_tokens, temperature, top_k, top_p, min_p, seed, presence_penalty, frequency_penalty,
                repetition_penalty, logit_bias, min_tokens, ignore_eos, logprobs, structured_output,
                prompt_logprobs, skip_special_tokens, include_stop_str_in_output: one value for all
                prompts, or a list with one value per prompt
                (see :meth:`stream`). A prompt with ``prompt_logprobs`` is read whole (no
                prompt-prefix reuse) and shares a prefill only with prompts asking the same.
            stop: stop string(s) for all prompts (a string or a list of strings), or per
                prompt a list whose items are each None or a list of strings.
            stop_token_ids: an id or a list of ids for all prompts, or per prompt a list
                whose items are each None or a list of ids.
            chat: apply the chat template to every text prompt.
            chat_template_kwargs: extra chat template variables for every chat prompt
                (see :meth:`encode_prompt`).
            tools: functions the model may call, for every chat prompt (see :meth:`encode_prompt`).

        Returns:
            one :class:`GenerationResult` per prompt, in order. ``decode_time`` counts the
            rounds the request was in (each round's time is the whole batch's).

        Raises:
            DFlashError: an invalid prompt or parameter (checked for every prompt before any
                decoding; with several prompts the message starts with the prompt's index,
                ``prompt 3: ...``, unless the value is the same for all prompts), a per-prompt
                list of the wrong length, or batch caches
                that do not fit; one prompt (token ids, chat messages) or one conversation as
                (role, content) pairs given as the list of prompts (the message says how to pass it).
        """
        if not isinstance(prompts, (list, tuple)) or not prompts:
            given = "an empty one" if isinstance(prompts, (list, tuple)) else type(prompts).__name__
            if getattr(prompts, "ndim", 0) == 2:  # (a tensor or NumPy array of token ids, a prompt a row)
                given = f"a 2-D {given} of shape {tuple(prompts.shape)}: {options.ROWS_HINT}"
            hint = options.tokenizer_output_hint(prompts, batch=True)
            raise DFlashError("prompts must be a non-empty list of prompts" + (hint or f", got {given}"))
        if all(isinstance(p, dict) for p in prompts) or all(
                hasattr(p, "__index__") and getattr(p, "ndim", 0) == 0 and not isinstance(p, (bool, list, str))
                for p in prompts):  # (token ids: ints, NumPy / torch scalars; not arrays or tensors of ids)
            raise DFlashError("prompts is a list of prompts, and this looks like one prompt (token ids or chat "
                              "messages): pass [prompt]")
        if len(prompts) > 1 and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                    and p[0] in CHAT_ROLES for p in prompts):  # (each prompt 0, 1: "pass [{'role': ...}]")
            raise DFlashError(f"prompts is a list of prompts, and this looks like one conversation of {len(prompts)} "
                              "(role, content) pairs: a chat message is a dict, and generate_batch takes a list of "
                              "conversations, each a list of message dicts: pass "
                              "[[{'role': role, 'content': content} for role, content in pairs]]")
        n = len(prompts)
        per = dict(max_new_tokens=_per_prompt(max_new_tokens, n, "max_new_tokens"),
                   temperature=_per_prompt(temperature, n, "temperature"), top_k=_per_prompt(top_k, n, "top_k"),
                   top_p=_per_prompt(top_p, n, "top_p"), min_p=_per_prompt(min_p, n, "min_p"), seed=_per_prompt(seed, n, "seed"),
                   presence_penalty=_per_prompt(presence_penalty, n, "presence_penalty"),
                   frequency_penalty=_per_prompt(frequency_penalty, n, "frequency_penalty"),
                   repetition_penalty=_per_prompt(repetition_penalty, n, "repetition_penalty"),
                   logit_bias=_per_prompt(logit_bias, n, "logit_bias"), min_tokens=_per_prompt(min_tokens, n, "min_tokens"),
                   ignore_eos=_per_prompt(ignore_eos, n, "ignore_eos"), logprobs=_per_prompt(logprobs, n, "logprobs"),
                   structured_output=_per_prompt(structured_output, n, "structured_output"),
                   stop=_per_prompt(stop, n, "stop", nested=(str,)),
                   stop_token_ids=_per_prompt(stop_token_ids, n, "stop_token_ids", nested=(int,)),
                   prompt_logprobs=_per_prompt(prompt_logprobs, n, "prompt_logprobs"),
                   skip_special_tokens=_per_prompt(skip_special_tokens, n, "skip_special_tokens"),
                   include_stop_str_in_output=_per_prompt(include_stop_str_in_output, n, "include_stop_str_in_output"))
        options.check_flag(chat, "chat")
        self._chat_options(chat_template_kwargs, tools)  # (one value for all prompts: its error names no prompt)
        requests = []
        for i, prompt in enumerate(prompts):  # every prompt is checked before any is decoded
            stopper = None  # (set: the options are fine, an error is about the prompt itself)
            try:
                given = per["max_new_tokens"][i]
                sampling = {name: values[i] for name, values in per.items()
                            if name not in ("prompt_logprobs", "max_new_tokens")}
                params, stopper = self.request_params(self._unfitted(given, sampling["min_tokens"]), **sampling)
                scored = options.check_prompt_logprobs(per["prompt_logprobs"][i])
                ids = self.encode_prompt(prompt, chat, chat_template_kwargs, tools)
                if given is None:
                    stopper.max_new_tokens = self._default_limit(ids, params.min_tokens)
                options.check_prompt_ids(ids, self.target.config, stopper.max_new_tokens, self.max_context)
            except DFlashError as exc:
                if n == 1 or (stopper is None and _shared_by_all(exc, per)):  # (no prompt to name)
                    raise
                raise _of_prompt(exc, i) from None
            requests.append((ids, params, stopper, scored, self.history_end(prompt, ids, chat, chat_template_kwargs, tools),
                             self.shared_end(prompt, ids, chat, chat_template_kwargs, tools)))
        with self._locked():
            if not self.batched:
                return compute.run(lambda: [self._collect(self._stream(*request[:5]), None) for request in requests])
            return compute.run(self._run_batch, requests)

    def _run_batch(self, requests: list) -> list[GenerationResult]:
        """Decode ``requests`` (prompt ids, params, stopper, prompt_logprobs, history end, shared
        start's end) through the batch decoder; on the compute thread."""
        batch = self.batch_decoder()
        if batch.seq_ids:  # (its rounds would step them too, and their Rounds would be lost)
            raise DFlashError(f"generate_batch cannot run while engine.batch_decoder() holds sequences of its own "
                              f"({len(batch.seq_ids)}: e.g. {batch.seq_ids[0]!r}); remove them first")
        results: list[GenerationResult | None] = [None] * len(requests)
        state = {}  # request index -> (stats, stopper, its chunks so far)
        waiting = list(range(len(requests)))
        try:
            while waiting or state:
                while waiting and batch.free_slots:
                    i = waiting.pop(0)
                    ids, params, stopper, scored, checkpoint, shared_end = requests[i]
                    stats = GenerationStats(prompt_tokens=len(ids), block_size=self.block_size,
                                            draft_mode=self.decoder.draft_mode if self.drafter is not None else None)
                    stopper.start(ids)
                    # (prefilled by the steps)
                    batch.join(i, ids, params, stopper.max_new_tokens, scored, checkpoint, shared_end)
                    state[i] = (stats, stopper, [])
                for i, rnd in batch.step(stop=compute.interrupted).items():  # (a lone prefill: between its chunks)
                    self._batch_round(batch, i, rnd, state, results)
                if compute.interrupted():
                    raise compute.stopped()
        finally:
            for i in state:  # an error or interrupt: free the slots (one that failed in its prefill is in none)
                if i in batch:
                    batch.remove(i)
        return results

    def _batch_round(self, batch: BatchDecoder, i: int, rnd: Round, state: dict, results: list) -> None:
        stats, stopper, chunks = state[i]
        try:
            chunks.append(self.record_round(rnd, stats, stopper))
        except DFlashError as exc:
            raise (_of_prompt(exc, i) if len(results) > 1 else exc) from None
        if chunks[-1].finish_reason is not None:
            results[i] = self._result(chunks)
            batch.remove(i)
            del state[i]

    @staticmethod
    def _finish_stats(stats: GenerationStats) -> None:
        taus = stats.acceptance_lengths
        stats.mean_acceptance_length = sum(taus) / len(taus) if taus else 0.0
        stats.acceptance_histogram = dict(sorted(Counter(taus).items()))
        if stats.decode_time > 0:
            stats.decode_tokens_per_second = (stats.generated_tokens - 1) / stats.decode_time


def _of_prompt(exc: DFlashError, i: int) -> DFlashError:
    """``exc`` about prompt ``i`` of a batch: its message after ``prompt i:``, of its class and
    with its attributes (a :class:`ContextLengthError` is still one; an :class:`OptionError`
    keeps its names, by which the command line names the flags)."""
    about = copy.copy(exc)
    about.args = (about_prompt(str(exc), i),)
    return about


def _per_prompt(value, n: int, name: str, nested: tuple[type, ...] = ()) -> list:
    """One value per prompt: ``value`` repeated ``n`` times, or ``value`` itself when it is a
    per-prompt list. With ``nested`` (the item types of a shared list, e.g. ``(str,)`` for
    ``stop``), a list is per prompt only when none of its items is of those types.

    Raises:
        DFlashError: a per-prompt list whose length is not ``n``; with ``nested``, a list that
            mixes those types with lists (neither a shared list nor one item per prompt).
    """
    value = options.plain(value, name)  # (a NumPy array of per-prompt values: a list)
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if nested and (not value or any(isinstance(v, nested) and not isinstance(v, bool) for v in value)):
        other = next((v for v in value if isinstance(v, (list, tuple)) or v is None), False)
        if other is not False:  # (a list, or a None: a prompt's own item beside the shared list's)
            kind = " or ".join(t.__name__ for t in nested)
            raise DFlashError(f"{name} mixes {kind} items and {'None' if other is None else 'lists'}: give one list of "
                              f"{kind} items for all prompts, or one item per prompt, each None or a list of {kind} items")
        return [value] * n
    if len(value) != n:
        raise DFlashError(f"{name} has {len(value)} values for {n} prompts (give one value, or one per prompt)")
    return list(value)


def _shared_by_all(exc: DFlashError, per: dict[str, list]) -> bool:
    """True when ``exc`` is about options that every prompt has the same value of (given
    once for all, or per prompt but equal)."""
    names = [name.replace(" ", "_") for name in getattr(exc, "names", ())]
    return bool(names) and all(name in per and all(v == per[name][0] for v in per[name]) for name in names)
