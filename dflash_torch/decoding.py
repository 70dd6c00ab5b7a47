"""The speculative decoding loop: prefill, then rounds of propose, verify, accept,
rollback and inject (README.md, "How it works").

:class:`SpeculativeDecoder` yields the tokens committed by each round; stopping
(EOS, stop strings, max_new_tokens) is the caller's job (see ``engine.py``), which
closes the iterator when it is done. Without a drafter (or with block size 1) the
same loop is plain autoregressive target-only decoding.
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import compute
from .cache import allocated, cache_bytes, common_start, most_that_fits
from .checkpoint import available_memory, memory_text
from .errors import CompileError, ContextOptionError, DFlashError, OptionError, first_line
from .models.drafter import DFlashDrafter, InjectedContext, RecomputedContext
from .models.gated_deltanet import CHUNK
from .models.target import TargetModel
from .options import (check_block_size, check_count, check_flag, check_max_context, check_max_new_tokens,
                      check_prompt_logprobs, check_prompt_ids, check_prompt_position, context_limit, n_tokens)
from .sampling import (LogitsProcessor, SamplingParams, TokenLogprob, accept_greedy, accept_sampling, choose,
                       first_logprobs, first_token, probabilities, token_logprobs)

DRAFT_MODES = ("inject", "recompute")


# SDPA backends for eager CUDA decoding: all but cuDNN attention, which builds (and
# caches) an execution plan for every new shape. Eager rounds attend over a key length
# that changes every round, so with cuDNN each round paid for a new plan: the first
# decode of a prompt ran ~9x slower than a repeat of it (issue 12).
EAGER_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class PrefillStopped(Exception):
    """A prompt's prefill that :attr:`SpeculativeDecoder.stop_prefill` ended between chunks."""


def without_shape_plans(step: Callable) -> Callable:
    """``step`` run with SDPA restricted to :data:`EAGER_CUDA_SDPA` (eager CUDA steps)."""

    @functools.wraps(step)
    def run(*args, **kwargs):
        with sdpa_kernel(EAGER_CUDA_SDPA):
            return step(*args, **kwargs)

    return run


# what a compile cache that an interrupted compile left damaged makes torch, its compiler or its
# linker say of a file (a truncated ``.so``, object file or pickle): "file too short", ...
CACHE_DAMAGE = re.compile(r"file too short|file truncated|invalid ELF header|file format not recognized|"
                          r"ran out of input|unexpected end of file", re.IGNORECASE)
# a line of a C++ compiler's or linker's output that says what went wrong (not "In file included
# from", a note or a warning): "x.cpp:3:1: error: ...", "/usr/bin/ld: cannot find -ltorch: ..."
COMPILER_ERROR = re.compile(r"\berror\b|\bld(\.\w+)?: |undefined reference|cannot find", re.IGNORECASE)
NO_COMPILE = "run without compiling (no --compile; bench: its modes without -compiled)"


def inductor_cache() -> str:
    """The directory of torch inductor's compile cache: ``TORCHINDUCTOR_CACHE_DIR``, else
    torch's default (``/tmp/torchinductor_$USER``), as an absolute path; unlike torch's own
    ``cache_dir()``, without creating it (which may be what failed)."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())


def compiler_error(output: str) -> str:
    """The first line of a C++ compiler's (or its linker's) ``output`` that says what went wrong
    (``x.cpp:3:1: error: ...``, ``/usr/bin/ld: cannot find -ltorch: ...``); its first line where
    none does, "" where it is empty."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return next((line for line in lines if COMPILER_ERROR.search(line)), lines[0] if lines else "")


def split_path(cmd: list[str]) -> str | None:
    """A path with spaces that the compiler command ``cmd`` (its arguments, as torch ran it) has
    split into several arguments (torch inductor puts library directories in it unquoted:
    ``-L/venvs/my env/lib/...`` is ``-L/venvs/my``, ``env/lib/...``): the longest run of
    arguments, the first's path (from its first ``/``) missing, that joined by spaces names one
    that exists. None where no argument is such a piece."""
    import os

    for i, arg in enumerate(cmd):
        head = arg[arg.find("/"):] if "/" in arg else ""
        if not head or os.path.exists(head):
            continue
        found, joined = None, head
        for piece in cmd[i + 1:i + 8]:
            joined += " " + piece
            if os.path.exists(joined):
                found = joined
        if found is not None:
            return found
    return None


def compile_failure(exc: BaseException) -> str:
    """The one-line message of ``exc``, a failure to compile a decoding step (a backend's,
    torch's ``BackendCompilerFailed``, or an ``OSError`` of torch.compile's about its cache):
    torch's reason, with what to do about it where the reason tells:

    - a C++ compile that failed (inductor's ``CppCompileError``): the compiler's or linker's
      first error line (not torch's "C++ compile error"), and where torch's command split a
      path with spaces (:func:`split_path`; the Python environment's), that torch's C++
      compile cannot handle one;
    - an ``OSError`` about inductor's cache directory (:func:`inductor_cache`; it cannot be
      created, or written: read-only, no space left): the error, naming the path and the
      reason, and ``TORCHINDUCTOR_CACHE_DIR`` to point elsewhere;
    - a sign of a damaged cache (:data:`CACHE_DAMAGE`: a 0-byte ``.so`` that an interrupted
      compile left makes every later compile that loads it fail, ``ImportError: ... file too
      short``): the cache to remove;
    - no C++ compiler (inductor's ``InvalidCxxCompiler``): to install one.

    The last two, and the message's ending with running without compiling, only where the
    backend is inductor (or the cache directory is named).

    Args:
        exc: the exception torch raised.

    Returns:
        one line, ``compiling the decoding graphs failed: <type>: <reason>[; <remedy>]``.
    """
    inner = getattr(exc, "inner_exception", exc)
    name, reason = type(inner).__name__, first_line(inner)
    output = getattr(inner, "output", None) if name in ("CppCompileError", "CUDACompileError") else None
    if isinstance(output, str):
        reason = compiler_error(output) or reason
    message = f"compiling the decoding graphs failed: {name}: {reason}"
    inductor = getattr(exc, "backend_name", None) == "inductor"
    cache = inductor_cache()
    filename = getattr(inner, "filename", None) if isinstance(inner, OSError) else None
    damaged = (isinstance(inner, EOFError) or name == "UnpicklingError" or CACHE_DAMAGE.search(str(inner))
               or CACHE_DAMAGE.search(output or ""))
    spaced = split_path(list(getattr(inner, "cmd", None) or [])) if output is not None else None
    if spaced is not None:
        return (f"{message}; torch's C++ compile cannot handle a path with spaces ({spaced!r}, which it split in its "
                f"compiler command): {NO_COMPILE}, or from a Python environment whose path has none")
    if inductor and damaged:
        message += f"; a damaged compile cache can cause this: remove {cache} (torch inductor's cache, TORCHINDUCTOR_CACHE_DIR)"
    elif isinstance(filename, str) and _related(filename, cache):
        return (f"{message}; torch inductor's cache directory (TORCHINDUCTOR_CACHE_DIR={cache}) must be one this "
                f"process can create and write: set TORCHINDUCTOR_CACHE_DIR to another, or {NO_COMPILE}")
    elif not inductor:
        return message
    elif name == "InvalidCxxCompiler":  # (a cache cannot help: no compiler to build with)
        message += "; torch inductor builds with a C++ compiler: install one (g++) or set CXX to it"
    return f"{message}; or {NO_COMPILE}"


def _related(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory``, in it, or one of the directories above it (one that
    creating ``directory`` creates, or fails to)."""
    import os

    path, directory = os.path.abspath(path), os.path.abspath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep) or \
        directory.startswith(path.rstrip(os.sep) + os.sep)


def check_models(target, drafter) -> None:
    """Refuse a decoder's ``target`` / ``drafter`` that are not the models it runs.

    Raises:
        DFlashError: ``target`` is not a :class:`TargetModel` or ``drafter`` not a
            :class:`DFlashDrafter` (or None); a :class:`~dflash_torch.engine.DFlashEngine`
            given for either is named, with the attribute that holds the model; a drafter whose
            weights are in another dtype (``float32`` / ``bfloat16``) or on another device than
            the target's (the dtype and device of their caches: the target's embedding table,
            the drafter's ``fc`` projection), naming both (a round would fail inside torch).
    """
    for value, name, kind in ((target, "target", TargetModel), (drafter, "drafter", DFlashDrafter)):
        if value is None and name == "drafter" or isinstance(value, kind):
            continue
        got = "TargetModel" if isinstance(value, TargetModel) else type(value).__name__  # (families' classes are "Model")
        hint = f" (pass engine.{name})" if hasattr(value, name) and hasattr(value, "tokenizer") else ""
        raise DFlashError(f"{name} must be a {kind.__name__}{' or None' if name == 'drafter' else ''}, got {got}{hint}")
    if drafter is None:
        return
    # (the tensors whose dtype and device each model's caches take: TargetModel.new_cache, DFlashDrafter.new_cache)
    t, d = target.model.embed_tokens.weight, drafter.fc.weight
    if t.device != d.device:
        raise DFlashError(f"the drafter is on {d.device} but the target on {t.device}: load both on one device "
                          "(DFlashEngine.from_pretrained(device=...) loads both)")
    if t.dtype != d.dtype:
        drafter_dtype, target_dtype = (str(w.dtype).removeprefix("torch.") for w in (d, t))
        raise DFlashError(f"the drafter's weights are {drafter_dtype} but the target's {target_dtype}: load both in "
                          "one dtype (DFlashEngine.from_pretrained(dtype=...) loads both)")


def context_caches(max_context: int, given: bool, note: str = "") -> str:
    """How a refusal of caches names the ``max_context`` that sizes them: ``max_context N``
    (``note`` after it, in parentheses), or where none was given, the target's context that
    it defaults to (the option named once, as the command line's messages rename it)."""
    if given:
        return f"max_context {max_context}" + (f" ({note})" if note else "")
    return f"the target's context, {max_context} tokens (the default max_context{'; ' + note if note else ''})"


def kv_bucket(n: int, capacity: int) -> int:
    """Keys to attend over when ``n`` positions must be visible (fixed shapes): the
    smallest power of two >= max(n, 256), capped at ``capacity`` (the cache's)."""
    b = 256
    while b < n:
        b *= 2
    return min(b, capacity)


def kv_buckets(lo: int, hi: int, capacity: int) -> list[int]:
    """The length buckets (:func:`kv_bucket`) of every ``n`` in ``[lo, hi]``, in increasing order."""
    out, last = [kv_bucket(lo, capacity)], kv_bucket(hi, capacity)
    while out[-1] < last:
        out.append(kv_bucket(out[-1] + 1, capacity))
    return out


def length_buckets(capacity: int) -> int:
    """How many length buckets a fixed-shape cache of ``capacity`` positions has: a
    compiled step builds one graph per bucket (per batch bucket, batched)."""
    return len(kv_buckets(1, capacity, capacity))


_graphs_reserved = 0  # graphs that the compiled decoders built in this process may hold, all together
# the _graphs_reserved that this thread's torch config was last brought up to by _apply_compile_settings
# (a ContextVar, as torch keeps its config overrides)
_settings_applied: ContextVar[int] = ContextVar("dflash_torch_settings_applied", default=-1)


def reserve_graphs(n: int) -> None:
    """Let every compiled step function hold ``n`` more graphs before torch.compile gives
    up on it.

    torch.compile keeps a function's graphs with its code, which every decoder in the
    process shares, and once a function holds ``torch._dynamo.config.recompile_limit``
    graphs (8 by default) it runs that function eager from then on, with only a log
    line. A fixed-shape decoder needs one graph per length bucket (times batch bucket
    when batched): 9 for a 40,960-token context, 16 for a batch of 8 over 2,048 tokens,
    and each compiled decoder of another model adds its own. So every compiled decoder
    reserves its graphs here and the limit is raised to the sum (never lowered): in the
    calling thread now, and in any other thread when it next calls a step built by
    :func:`compile_step` (torch's config settings are per thread).

    Raises:
        CompileError: ``torch._dynamo`` could not be imported for the file system's reason
            (see :func:`_apply_compile_settings`).
    """
    global _graphs_reserved
    _graphs_reserved += n
    _apply_compile_settings()


def check_cache_variable() -> None:
    """Refuse ``TORCHINDUCTOR_CACHE_DIR`` set to an empty string: torch takes it for the current
    directory, filling it with its cache folders, one of which (``z3``) a later compile there
    imports as the z3 module and fails on (trial-303).

    Raises:
        CompileError: one line naming the variable."""
    import os

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == "":
        raise CompileError("TORCHINDUCTOR_CACHE_DIR is set but empty, which torch takes for the current directory "
                           "(its compile cache would fill it): unset it, or set it to a directory")


def _apply_compile_settings() -> None:
    """Raise this thread's recompile limits to the graphs reserved (:func:`reserve_graphs`)
    and tag its compile caches (:func:`tag_compile_caches`). torch keeps a config value set
    in one thread to that thread (a ``ContextVar``): a thread that did not set it compiles
    with torch's default.

    Raises:
        CompileError: importing ``torch._dynamo`` (this process's first) failed on the file
            system: torch creates inductor's cache directory then (:func:`compile_failure`).
    """
    check_cache_variable()
    try:
        importlib.import_module("torch._dynamo")
    except OSError as exc:  # (TORCHINDUCTOR_CACHE_DIR that cannot be created, say: torch's makedirs at import)
        raise CompileError(compile_failure(exc)) from exc
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, _graphs_reserved)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, _graphs_reserved)
    tag_compile_caches()
    _settings_applied.set(_graphs_reserved)


def compile_step(fn: Callable, **opts) -> Callable:
    """``torch.compile(fn, **opts)``, called with this package's compile settings (the
    recompile limit of :func:`reserve_graphs`, the cache tag of :func:`tag_compile_caches`)
    applied in the calling thread: a decoder may be built in one thread and driven in
    another (the compute thread, :func:`~dflash_torch.compute.run`), and torch's config
    settings are per thread. They are applied at a thread's first call and after each
    reservation (a check of one ``ContextVar`` per call otherwise). A failure to build a graph
    (torch's ``BackendCompilerFailed``, inductor's ``InductorError`` among them) raises
    :class:`~dflash_torch.errors.CompileError` with :func:`compile_failure`'s message (torch's
    error as its cause) instead of torch's long traceback; so does an ``OSError`` of
    ``torch.compile`` itself (each call creates inductor's cache directory, and importing
    ``torch._dynamo`` does: ``TORCHINDUCTOR_CACHE_DIR`` on a read-only file system, say), and
    ``TORCHINDUCTOR_CACHE_DIR`` set empty (:func:`check_cache_variable`)."""
    check_cache_variable()
    try:
        from torch._dynamo.exc import BackendCompilerFailed

        compiled = torch.compile(fn, **opts)
    except OSError as exc:
        raise CompileError(compile_failure(exc)) from exc

    @functools.wraps(fn)
    def step(*args, **kwargs):
        if _settings_applied.get() != _graphs_reserved:
            _apply_compile_settings()
        try:
            return compiled(*args, **kwargs)
        except BackendCompilerFailed as exc:
            raise CompileError(compile_failure(exc)) from exc

    return step


def tag_compile_caches() -> str:
    """Tie torch.compile's on-disk caches to the signatures of this package's custom
    operators -> the tag set (``torch.compiler.config.cache_key_tag``, after any tag of the
    user's own).

    Inductor's cache keys do not cover a custom operator's schema, so code compiled
    against one version of an operator's arguments (say, before an argument was renamed)
    would be loaded again after an upgrade and fail when it runs ("Unknown keyword argument
    ... for operator 'dflash_torch::...'"). The tag is a hash of every ``dflash_torch::``
    operator's schema: a change to any of them misses the old entries."""
    import hashlib

    from .models import fp8, moe, nvfp4, packed_int  # noqa: F401  (their operators registered)

    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("dflash_torch::"))
    schemas = "\n".join(str(getattr(torch.ops.dflash_torch, n.split("::", 1)[1]).default._schema) for n in names)
    ours = "dflash_torch-ops-" + hashlib.sha256(schemas.encode()).hexdigest()[:16]
    config = torch.compiler.config
    user = config.cache_key_tag.split("dflash_torch-ops-")[0].rstrip("+")
    config.cache_key_tag = f"{user}+{ours}" if user else ours
    return config.cache_key_tag


def eager_fallbacks() -> int:
    """Compiled functions that torch.compile stopped compiling in this process because
    they reached the recompile limit: they run eager from then on (a silent loss of
    most of the speed compiling is for). Counted from torch's compile counters; 0 where
    ``torch._dynamo`` was never imported (nothing was compiled: importing it, a second or
    more, would stall the caller, e.g. a server's first ``/metrics``)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith("Dynamo recompile limit"))


def compile_counts() -> tuple[int, int]:
    """(frames traced, CUDA graphs skipped) so far in this process, from torch's compile
    counters. Every compile or recompile traces a frame (also a re-trace that gives a
    graph identical to one built before); a skipped CUDA graph is a compiled graph that
    inductor runs without CUDA graphs (e.g. "mutated inputs"), paying every kernel
    launch on the host again. ``(0, 0)`` where ``torch._dynamo`` was never imported
    (nothing was compiled)."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"]), int(counters["inductor"]["cudagraph_skips"])


def graphs_built() -> int:
    """Graphs torch.compile has built so far in this process (TorchDynamo's count of the
    graphs it compiled: each compile or recompile that made one, a re-trace that gave a graph
    identical to one built before too; not a frame it traced without making a graph). 0
    where ``torch._dynamo`` was never imported (nothing was compiled)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def prompt_chunk_logprobs(logits: torch.Tensor, prompt: list[int], c0: int, top: int) -> list[TokenLogprob | None]:
    """The prompt logprobs that a prefill chunk's logits give: row ``r`` of ``logits``
    (``[rows, V]``, the chunk's valid rows, at positions ``c0 + r``) scores prompt token
    ``c0 + r + 1``, so the chunk gives those of tokens ``c0 + 1 .. c0 + rows`` that are in
    ``prompt`` (its last row, at the prompt's end, scores no prompt token), preceded by
    None for token 0 when ``c0`` is 0 (nothing before it scores it). Float32
    ``log_softmax`` of the raw logits, ``top`` alternatives each
    (:func:`~dflash_torch.sampling.token_logprobs`; one device-to-host transfer)."""
    out: list[TokenLogprob | None] = [None] if c0 == 0 else []
    m = min(logits.shape[0], len(prompt) - 1 - c0)
    if m > 0:
        out += token_logprobs(logits[:m], prompt[c0 + 1:c0 + 1 + m], top)
    return out


@dataclass
class Round:
    """What one step of the loop committed.

    Attributes:
        tokens: committed token ids, in order (the prefill step commits one token;
            a decoding round commits tau = accepted + 1 tokens).
        acceptance_length: tau of a decoding round, None for the prefill step.
        propose_time: seconds spent drafting (about 0 without a drafter: the round's bookkeeping).
        verify_time: seconds of the target forward with the acceptance and its one host sync
            (and, where asked, the logits processing and logprobs; the prefill time for the
            prefill step).
        total_time: seconds of the whole step; what it holds beyond ``propose_time`` and
            ``verify_time`` is the drafter context's update (``recompute``'s feature rows
            appended, ``inject``'s carried to the next propose) and, for a hybrid target, the
            commit of the accepted rows into its recurrent state.
        cached_tokens: prompt tokens of the prefill step taken from a retained prefix
            instead of read (prefix reuse, ``reuse_prefix`` of this decoder or of
            :class:`~dflash_torch.batch.BatchDecoder`; else 0).
        logprobs: with ``SamplingParams.logprobs`` set, one
            :class:`~dflash_torch.sampling.TokenLogprob` per token of ``tokens`` (the
            target's distribution at its position: the verify's row for an accepted or
            bonus token, the prompt's last row for the prefill's token); else None.
        prompt_logprobs: on the prefill step of a sequence that asked for them
            (``prompt_logprobs=k``), one entry per prompt token: None for the first, then
            :class:`~dflash_torch.sampling.TokenLogprob` of each token from the prefill's row
            before it (:func:`prompt_chunk_logprobs`); else None.
        error: set when the sequence cannot go on: its structured-output constraint failed
            (:attr:`~dflash_torch.structured.GrammarState.failed`; the round's tokens end it
            with an EOS and should not be shown as a normal end). The caller reports it for
            this sequence alone.
        complete_after: with a structured-output constraint that is complete after some of
            the round's tokens and allows only an EOS there (all of them, or all but the EOS
            that ends them): how many; else None
            (:attr:`~dflash_torch.structured.GrammarState.complete_after`). An output cut there
            by ``max_new_tokens`` has ended as the constraint ends it.
    """

    tokens: list[int]
    acceptance_length: int | None
    propose_time: float
    verify_time: float
    total_time: float
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    complete_after: int | None = None

    @staticmethod
    def processed(processor: LogitsProcessor | None) -> dict:
        """The fields a sequence's logits processor (None: none) sets after its commit:
        ``error`` and ``complete_after``."""
        if processor is None:
            return {}
        return {"error": processor.error, "complete_after": processor.complete_after}


@dataclass
class _Kept:
    """What the caches hold at a yield of a run (prefix reuse, see ``SpeculativeDecoder``'s
    ``reuse_prefix``): the rows of every token of ``tokens`` (the prompt, then the tokens
    committed) but the last, and the drafter context of those before ``pending``'s rows
    (``(features [n, F], start)``: the last verify's, which the next propose injects; or
    None). A round writes no row before ``len(tokens) - 1`` but those pending rows, with the
    same values: left midway (an exception, Ctrl-C), it leaves these rows valid, except where
    the caches cannot go back. ``saved``: where the caches cannot go back (recurrent states,
    rings), copies of those tensors at position ``saved_at`` of the prompt (its end, or the
    ``checkpoint`` of :meth:`SpeculativeDecoder.rounds`), else None; ``logits``: the prompt's
    (``prompt_len`` tokens) last logits ``[V]`` (the same prompt again reads nothing), or None
    where a prefill was left midway (``tokens``: the start of the prompt it had read, a chunk
    at a time; the caches can go back there)."""

    tokens: list[int]
    prompt_len: int
    saved: list[torch.Tensor] | None
    saved_at: int
    logits: torch.Tensor | None
    pending: tuple | None = None


ROUND_WAIT_S = 10.0  # seconds the compute thread waits for another thread's round of the same decoder


class _Rounds:
    """The iterator :meth:`SpeculativeDecoder.rounds` returns: its ``_decode`` generator, one
    round at a time. Every round (the first one, which resets the caches, included) is refused
    from another thread while the compute thread runs an engine call
    (:func:`~dflash_torch.compute.check_caller`), and while another thread is inside a round of
    the same decoder; the compute thread's own round waits for that one to end instead, up to
    ``ROUND_WAIT_S`` seconds (a round of another thread could wait on the compute thread itself:
    a stream the garbage collector closes in it). Between rounds (at a yield) nothing is held.
    A refused round leaves the iterator as it was (nothing decoded): it may be resumed later.
    (A round from another thread ran in the middle of an engine's generate and changed the
    caches under it: wrong tokens, no error.) :meth:`close` waits for the generator's own
    round only (``_own``: held while it runs or closes), not for another generator's."""

    __slots__ = ("_decoder", "_rounds", "_started", "_own")

    def __init__(self, decoder: SpeculativeDecoder, rounds: Iterator[Round]):
        self._decoder, self._rounds, self._started = decoder, rounds, False
        self._own = threading.Lock()  # (held while its generator runs: a round or its close)

    def __iter__(self) -> _Rounds:
        return self

    @staticmethod
    def _take(lock: threading.Lock, name: str) -> None:
        """Take ``lock`` (the decoder's round lock, or a generator's own) for ``name``: the
        compute thread waits for another thread's round up to ``ROUND_WAIT_S`` seconds, another
        thread is refused at once.

        Raises:
            DFlashError: ``lock`` not taken (another thread's round runs)."""
        if compute.on_compute_thread():
            if not lock.acquire(timeout=ROUND_WAIT_S):
                raise DFlashError(f"{name} waited {ROUND_WAIT_S:g} s for another thread's round of this "
                                  "SpeculativeDecoder to end: drive every rounds() generator of it through "
                                  "dflash_torch.compute.run, which runs them in turn")
        elif not lock.acquire(blocking=False):
            raise DFlashError(f"{name} was called while another thread is inside a round of this "
                              "SpeculativeDecoder, which decodes one round at a time: drive every "
                              "rounds() generator of it through dflash_torch.compute.run (the other "
                              "thread's too), which runs them in turn")

    def __next__(self) -> Round:
        stepping, name = self._decoder._stepping, "next() of a SpeculativeDecoder.rounds() generator"
        if not compute.on_compute_thread():
            compute.check_caller(name)
        self._take(stepping, name)
        try:
            if not self._started:  # (its first round resets the caches: not under a holder's rounds)
                holder = self._decoder._holder
                if holder is not None and holder is not self:
                    raise DFlashError(self._decoder._held_message(f"the first {name}"))
                self._started = True
            with self._own:  # (free but while another thread closes it: a moment)
                return next(self._rounds)
        finally:
            stepping.release()

    def close(self) -> None:
        """Close the generator (as a generator's ``close()``: it decodes no more). One between
        rounds (or not started) is closed at once, whatever round of the decoder runs (closing
        it touches no cache). One inside a round in another thread (it was a bare ValueError
        "generator already executing") is, as :meth:`__next__` is then: closed after that round
        on the compute thread, which waits for it up to ``ROUND_WAIT_S`` seconds; refused on
        any other thread.

        Raises:
            DFlashError: its round runs in another thread, and this is not the compute thread
                (or the compute thread waited ``ROUND_WAIT_S`` seconds for it)."""
        self._take(self._own, "close() of a SpeculativeDecoder.rounds() generator")
        try:
            self._rounds.close()
        finally:
            self._own.release()


class SpeculativeDecoder:
    """DFlash speculative decoding for one sequence at a time.

    Args:
        target: the target model.
        drafter: a DFlash drafter, or None for target-only decoding.
        block_size: tokens per block B (default: the drafter's); at most the drafter's.
        draft_mode: ``"inject"`` (persistent drafter KV cache) or ``"recompute"``.
        prefill_chunk: prompt tokens per prefill forward (the last chunk is padded in
            fixed-shape mode); one above ``max_context`` is taken as ``max_context``.
        static: fixed-shape rounds: caches preallocated for ``max_context`` tokens,
            the committed length enters as a device tensor, attention runs under a mask
            over a length bucket of the buffer (the smallest of 256, 512, 1024, ... tokens,
            capped at the buffer, that holds the block), inject always takes the B rows
            of the verify block, prefill runs in fixed-size chunks. Implied by
            ``compile``; a compiled step gets one graph per bucket, built the first time
            a sequence reaches that bucket.
        compile: wrap prefill, propose (which injects the previous verify's features in
            the same pass) and verify with ``torch.compile``
            (CPU: inductor; CUDA: mode "reduce-overhead", i.e. CUDA graphs; :func:`compile_step`:
            a graph that torch fails to build raises :class:`~dflash_torch.errors.CompileError`,
            as does, when the decoder is made, a compile cache directory torch cannot create).
        max_context: longest prompt + generation (tokens); default: the target's
            context (:func:`~dflash_torch.options.target_context`).
        compile_backend: torch.compile backend (default "inductor").
        compile_mode: torch.compile mode (default: "reduce-overhead" on CUDA, the
            compiler's default elsewhere); e.g. "max-autotune" (CUDA graphs too, with
            GEMM autotuning: minutes more to compile).
        reuse_prefix: prefix reuse (default False): the caches keep the last sequence's
            rows, and a prompt that starts with its tokens (the next turn of a
            conversation: the last prompt, its reply, a new message) goes on from them
            and reads only the rest (:attr:`Round.cached_tokens`). The rows are those of
            the last sequence's prompt and every token committed but its last; the prompt's
            last token is read (its logits choose the first token), unless it is the very
            same prompt again (its last logits are kept). A hybrid target's
            recurrent state, and a sliding-window layer's ring (target or drafter), hold only
            the last position written; for such models a copy of them is also kept at the end
            of the last prompt, so a prompt reuses all the rows when it holds them all, else
            those of the last prompt when it starts with it (a reply cut by a stop string, a
            chat template that renders the last reply without its thinking), else none. A
            request with ``prompt_logprobs`` reads its whole prompt. The output is the same
            as without (token for token in float32).

    Raises:
        DFlashError: a target or drafter that is not one, or a drafter in another dtype or on
            another device than the target (:func:`check_models`), invalid
            block size, draft mode, or a mode combination that cannot work;
            with fixed shapes, caches of ``max_context`` that do not fit in 90% of the
            device's free memory (an :class:`~dflash_torch.errors.OptionError` naming
            ``max_context``, before allocating them).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        block_size: int | None = None,
        draft_mode: str = "inject",
        prefill_chunk: int = 256,
        static: bool = False,
        compile: bool = False,
        max_context: int | None = None,
        compile_backend: str = "inductor",
        compile_mode: str | None = None,
        reuse_prefix: bool = False,
    ):
        if draft_mode not in DRAFT_MODES:
            raise DFlashError(f"draft mode must be one of {', '.join(DRAFT_MODES)}, got {draft_mode!r}")
        check_models(target, drafter)
        self.target, self.drafter, self.draft_mode = target, drafter, draft_mode
        trained = drafter.config.block_size if drafter is not None else None
        block_size = check_block_size(block_size, trained, context=context_limit(target.config)) or trained or 1
        self.static = static or compile
        if self.static and drafter is not None and draft_mode == "recompute":
            fixed = "compile" if compile else "static"
            raise OptionError(f"draft_mode 'recompute' grows its shapes every round; it cannot run with {fixed} "
                              "(fixed shapes)", "draft_mode", fixed)
        self.max_context = check_max_context(max_context, target.config)
        self._context_given = max_context is not None  # (refusals name the target's context otherwise)
        self.block_size = block_size
        # (a chunk longer than the context reads any prompt in one forward, as the context does: its
        # buffers were sized by it, 8 bytes a token before the first prompt)
        self.prefill_chunk = min(check_count(prefill_chunk, "prefill_chunk"), self.max_context)
        self.max_rows = max(block_size, self.prefill_chunk)  # the most rows one forward writes (rings: see cache.py)
        self.target_cache = target.new_cache(self.max_rows)
        self._run = 0  # the rounds() generator that owns the caches (a later call takes them over)
        self._stepping = threading.Lock()  # (held by the round running: see _Rounds)
        # what holds this decoder across rounds, e.g. a DFlashEngine's open request (see hold): meanwhile
        # a rounds() call, or the first round of another generator, is refused instead of taking over its caches
        self.held_by: str | None = None
        self._holder: _Rounds | None = None
        self.reuse_prefix = check_flag(reuse_prefix, "reuse_prefix")
        self.reused_prefill_tokens = 0  # prompt tokens taken from the caches instead of read, over all runs
        self.prefill_tokens = 0  # prompt tokens read, over all runs
        # called between prefill chunks: True ends the prefill there (PrefillStopped; a server's request went away)
        self.stop_prefill: Callable[[], bool] | None = None
        self._kept: _Kept | None = None  # prefix reuse: None while a step writes the caches
        self._prefilled = 0  # rows of the prompt of the run that prefills now that the caches hold (_prefill)
        self.feature_layers = drafter.feature_layers(target) if drafter is not None and block_size > 1 else None
        if self.feature_layers is None:
            self.context = None
        elif draft_mode == "inject":
            self.context = InjectedContext(drafter, max_rows=self.max_rows)
        else:
            self.context = RecomputedContext(drafter)
        self.device = target.model.embed_tokens.weight.device
        self._arange_block = torch.arange(block_size, device=self.device)
        self._arange_chunk = torch.arange(self.prefill_chunk, device=self.device)
        mask_id = drafter.config.mask_token_id if drafter is not None else 0
        # where the caches cannot go back to an earlier position (see reuse_prefix)
        rings = self.target_cache.kv.rings + (self.context.cache.rings if isinstance(self.context, InjectedContext) else [])
        self._whole_prefix_only = target.recurrent or any(r is not None for r in rings)
        self._mask_tail = torch.full((block_size - 1,), mask_id, dtype=torch.long, device=self.device)
        if self.static:  # preallocate once: buffer shapes never change afterwards
            capacity = self.max_context + self.max_rows + 1
            self._check_fits()  # (the caches reset allocates)
            try:
                self.target_cache.reset(capacity)
                if self.context is not None:
                    self.context.reset(capacity)
            except torch.OutOfMemoryError:
                raise OptionError(f"out of memory allocating the caches of "
                                  f"{context_caches(self.max_context, self._context_given)}; {self._lower_it}",
                                  "max_context") from None
        # hybrid targets: a verify leaves the recurrent layers' state as it was and the
        # accepted prefix is committed into it afterwards (their rollback)
        self.defer_commit = target.recurrent and block_size > 1
        if self.defer_commit and block_size > CHUNK:
            raise DFlashError(f"block size {block_size} exceeds {CHUNK}, the longest verify block of a hybrid target")
        self._prefill_fn, self._draft_fn, self._verify_fn = self._prefill_step, self._draft_step, self._verify_step
        self._commit_fn = self._commit_step
        if self.device.type == "cuda" and not compile:
            self._prefill_fn, self._draft_fn, self._verify_fn = map(
                without_shape_plans, (self._prefill_step, self._draft_step, self._verify_step))
        self.compiled = compile
        # modes "reduce-overhead" and "max-autotune" run CUDA graphs
        self.graphed = compile and self.device.type == "cuda" and compile_mode in (None, "reduce-overhead", "max-autotune")
        if compile:
            if compile_mode is None and self.device.type == "cuda":
                compile_mode = "reduce-overhead"
            opts = dict(dynamic=False, backend=compile_backend, mode=compile_mode)
            reserve_graphs(length_buckets(self.target_cache.capacity))
            self._prefill_fn = compile_step(self._prefill_step, **opts)
            self._draft_fn = compile_step(self._draft_step, **opts)
            self._verify_fn = compile_step(self._verify_step, **opts)
            self._commit_fn = compile_step(self._commit_step, **opts)

    def _check_fits(self) -> None:
        """Fixed shapes: the caches of ``max_context`` (``max_context + max_rows + 1`` positions,
        as ``__init__`` allocates them) must fit in 90% of the device's free memory (as the batch
        decoder's), else :class:`OptionError` naming ``max_context``."""
        drafter = self.drafter if isinstance(self.context, InjectedContext) else None

        def need_of(context: int) -> int:  # (the caches of a max_context, sized as __init__ sizes them)
            rows = max(self.block_size, min(self.prefill_chunk, context))
            return cache_bytes(self.target, drafter, 1, allocated(context + rows + 1), rows, False, rows)

        self._refuse_context(need_of, "fixed shapes: allocated at once")

    def _refuse_context(self, need_of: Callable[[int], int], how: str) -> None:
        """:class:`OptionError` naming ``max_context`` (and the most that fits, in tokens) where
        ``need_of(max_context)``, the bytes of the caches of a context, does not fit in 90% of
        the device's free memory; ``how``: how those caches are held, said in the message."""
        free = available_memory(self.device)
        need = need_of(self.max_context)
        if free is None or need <= 0.9 * free:
            return
        caches = context_caches(self.max_context, self._context_given, how)
        most = most_that_fits(need_of, self.max_context, 0.9 * free)
        raise OptionError(f"the caches of {caches} need {memory_text(need, True)} but {self.device.type} has "
                          f"{memory_text(free, True)} free; {self._lower_it}"
                          + (f" (at most {most} fits in 90% of that)" if most else ""), "max_context")

    def _grown_bytes(self, context: int) -> int:
        """Bytes of the growing caches (not fixed shapes) that a sequence of ``context`` tokens
        (prompt + new tokens) makes them allocate: ``context + block_size + 1`` positions, rounded
        up to 256."""
        drafter = self.drafter if isinstance(self.context, InjectedContext) else None
        return cache_bytes(self.target, drafter, 1, allocated(context + self.block_size + 1), self.max_rows, False,
                           self.max_rows)

    def check_context_fits(self) -> None:
        """Growing caches (not fixed shapes, whose caches of ``max_context`` were checked when
        the decoder was built): the caches of one sequence of ``max_context`` tokens, to which a
        request's prompt + ``max_new_tokens`` may grow them, must fit in 90% of the device's free
        memory, as the batch decoder's slots must. A server of one slot checks it at start, so
        that requests that leave out ``max_tokens`` (the rest of the context) are not each
        refused for memory instead.

        Raises:
            OptionError: naming ``max_context`` and the most that fits (in tokens), where
                they do not fit.
        """
        if not self.static:
            self._refuse_context(self._grown_bytes, "one sequence, as a request may grow them")

    def _check_room(self, n_prompt: int, max_new_tokens: int, left: int | None = None) -> None:
        """Growing caches (not fixed shapes), before a request's first work: those of its
        ``n_prompt + max_new_tokens + block_size + 1`` positions (rounded up to 256, as they are
        allocated) must fit in 90% of the device's free memory, else :class:`OptionError`
        naming ``max_new_tokens`` and the most new tokens whose caches fit (the allocation
        would fail with torch's out-of-memory error, or the process be killed by the system).
        The caches held now count as used (they are copied when they grow).

        ``left``: where ``max_new_tokens`` goes past the context, the new tokens the context
        leaves (``max_context - n_prompt``): refused (a
        :class:`~dflash_torch.errors.ContextOptionError`, naming the most that fit) only where
        the caches of fewer than those fit, so that the advice names the lower of the two
        limits; otherwise the caller refuses it for the context."""
        asked = max_new_tokens if left is None else left
        if self.static or allocated(n_prompt + asked + self.block_size + 1) <= self.target_cache.capacity:
            return  # (fixed shapes, or caches that hold them already)
        free = available_memory(self.device)
        if free is None:
            return
        room = 0.9 * free

        def need(new_tokens: int) -> int:
            return self._grown_bytes(n_prompt + new_tokens)

        if need(asked) <= room:
            return
        most = most_that_fits(need, asked, room)
        ask = (f"ask for at most {most} new token{'s' * (most != 1)} (their caches fit in 90% of that)" if most else
               "the caches of one new token do not fit in 90% of that: give a shorter prompt")
        if left is not None:
            raise ContextOptionError(f"prompt ({n_tokens(n_prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the "
                                     f"context of {self.max_context} tokens, and the caches of the {left} new "
                                     f"token{'s' * (left != 1)} it leaves need {memory_text(need(left), True)} but "
                                     f"{self.device.type} has {memory_text(free, True)} free; {ask}", "max_new_tokens")
        raise OptionError(f"the caches of the prompt ({n_tokens(n_prompt)}) + max_new_tokens ({max_new_tokens}) need "
                          f"{memory_text(need(max_new_tokens), True)} but {self.device.type} has "
                          f"{memory_text(free, True)} free; {ask}", "max_new_tokens")

    @property
    def _lower_it(self) -> str:
        """What a refusal of caches too large asks of ``max_context``."""
        return "lower it" if self._context_given else "give a lower one"

    def kv_bucket(self, n: int) -> int:
        """Keys to attend over when ``n`` positions must be visible (fixed shapes,
        :func:`kv_bucket` of the buffer's capacity)."""
        return kv_bucket(n, self.target_cache.capacity)

    @torch.inference_mode()
    def warmup(self, context: int) -> int:
        """Call every compiled step once at every length bucket that a sequence of up to
        ``context`` tokens (prompt + generated) reaches, on zeros, so that the graphs are
        built now rather than while a request decodes (a new bucket costs a compile: about
        10 to 30 s on a CPU). It writes the caches, which the next :meth:`rounds` resets.

        Args:
            context: tokens, capped at ``max_context``.

        Returns:
            the length buckets warmed up (0 when not compiled).
        """
        self._kept = None
        if not self.compiled:
            return 0
        context = max(2, min(context, self.max_context))
        B, C, dev = self.block_size, self.prefill_chunk, self.device
        # prefill chunks start at multiples of C below the longest prompt (context - 1 tokens);
        # with prefix reuse, anywhere below it
        cap = self.target_cache.capacity
        last_chunk = context - 2 if self.reuse_prefix else (context - 2) // C * C
        for kv_len in kv_buckets(C, last_chunk + C, cap):
            chunk = torch.zeros(C, dtype=torch.long, device=dev)
            self._prefill_fn(chunk, torch.tensor(kv_len - C, device=dev), kv_len, torch.tensor(C, device=dev))
        lengths = kv_buckets(1 + B, context - 1 + B, cap)
        for kv_len in lengths:
            pos = torch.tensor(kv_len - B, device=dev)
            token = torch.zeros((), dtype=torch.long, device=dev)
            pending = None
            if B > 1:
                if isinstance(self.context, InjectedContext):
                    pending = self.drafter.fc.weight.new_zeros(B, self.drafter.fc.in_features)
                self._draft_fn(token, pos, kv_len, pending, pos.clone() if pending is not None else None)
            feats = self._verify_fn(torch.zeros(B, dtype=torch.long, device=dev), pos, kv_len)[1]
            if pending is not None:  # (as a round does: CUDA graphs' outputs out of their pool before the commit)
                self._carry(feats)
            if self.defer_commit:
                self._commit_fn(torch.ones((), dtype=torch.long, device=dev))
        return len(lengths)

    # --- the per-round steps (fixed shapes when ``s`` is a tensor and ``kv_len`` a bucket) ---

    def _prefill_step(self, ids: torch.Tensor, start, kv_len: int | None, valid=None):
        """prefill: the target reads a prompt chunk at ``[start, start + len(ids))``; recurrent
        layers advance over its first ``valid`` rows (all when None)."""
        positions = start + self._arange_chunk[: ids.shape[0]]
        return self.target(ids, positions, self.target_cache, kv_len, self.feature_layers, commit=valid)

    def _draft_step(self, token: torch.Tensor, s, kv_len: int | None, features: torch.Tensor | None = None,
                    feature_start=None):
        """propose: the drafter denoises ``[token, mask, ...]`` at ``[s, s+B)`` -> its draft
        scores (:meth:`~dflash_torch.models.drafter.DFlashDrafter.draft_scores`: the draft
        logits ``[B-1, V]`` of a DFlash drafter, the candidate lattice of a DFlash 2 one);
        first, in the same pass, inject the last verify's ``features`` rows at
        ``[feature_start, feature_start + rows)`` (inject mode; None in the first round).
        No sampling parameter enters this step, so a compiled graph serves every request."""
        block = torch.cat([token.view(1), self._mask_tail])
        inject = None
        if features is not None:
            inject = (features, feature_start + self._arange_block[: features.shape[0]])
        hidden = self.drafter(self.drafter.embed(self.target, block), s + self._arange_block, self.context, kv_len,
                              mask_keys=self.static, inject=inject)
        return self.drafter.draft_scores(hidden, token, self.target)

    def _verify_step(self, block: torch.Tensor, s, kv_len: int | None):
        """verify: the target reads the block at ``[s, s+B)`` -> logits ``[B, V]``, features ``[B, k*H]``."""
        return self.target(block, s + self._arange_block[: block.shape[0]], self.target_cache, kv_len, self.feature_layers,
                           defer_commit=self.defer_commit)

    def _commit_step(self, rows: torch.Tensor) -> None:
        """rollback of recurrent layers: advance their state over the first ``rows`` tokens of the last verify."""
        self.target.commit(self.target_cache, rows)

    def _carry(self, feats: torch.Tensor) -> torch.Tensor:
        """Right after a verify: its feature rows as the next propose reads them.

        A CUDA graph's outputs live in its memory pool, where the next graph's replay may
        overwrite them. Two outputs of a CUDA-graphed verify are read by another graph: the
        feature rows (by the next propose, the folded injection) and, for a hybrid target,
        the recurrent layers' stash (by the commit). Both are copied out of the pool here.
        Elsewhere the rows are passed on as they are."""
        if not self.graphed:
            return feats
        if self.defer_commit:
            self.target_cache.recurrent.copy_stash()
        return feats.clone()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prefill(self, ids: torch.Tensor, n_prompt: int, scored: list | None = None, prompt: list[int] | None = None,
                 top: int = 0, start: int = 0) -> torch.Tensor:
        """Run the prompt from position ``start`` through the target chunk by chunk, injecting
        every row's features; returns the logits ``[V]`` of the last prompt row. With ``scored`` (a
        list), each chunk's valid rows also score the prompt's tokens (``prompt``, ``top``
        alternatives; :func:`prompt_chunk_logprobs`), appended to it as the chunk is read
        (before the next chunk's forward: a CUDA graph's replay may reuse the logits' memory).

        ``_prefilled``: the positions whose rows are written (target and drafter context), after
        each chunk: where the prefill is left midway (an exception, Ctrl-C inside a chunk),
        ``rounds`` keeps those rows for the next request where the caches can go back (else it
        has dropped the kept prefix by then, and the next request prefills anew).

        Raises:
            KeyboardInterrupt: the caller of the compute thread's call got Ctrl-C
                (:func:`~dflash_torch.compute.interrupted`), seen between chunks.
            PrefillStopped: :attr:`stop_prefill` said so, between chunks (the same)."""
        C = self.prefill_chunk
        for c0 in range(start, n_prompt, C):
            if c0 > start and compute.interrupted():  # the caller got Ctrl-C: stop between chunks (nothing kept)
                raise compute.stopped()
            if c0 > start and self.stop_prefill is not None and self.stop_prefill():
                raise PrefillStopped(f"the prefill was stopped after {c0} of {n_prompt} prompt tokens")
            c1 = min(c0 + C, n_prompt)
            if self.static:  # fixed chunk shape: pad; pad rows land past the prompt and get overwritten
                chunk = torch.zeros(C, dtype=torch.long, device=self.device)
                chunk[: c1 - c0] = ids[c0:c1]
                logits, feats = self._prefill_fn(chunk, torch.tensor(c0, device=self.device), self.kv_bucket(c0 + C),
                                                 torch.tensor(c1 - c0, device=self.device))
                last = logits[c1 - c0 - 1]
                if scored is not None:
                    scored += prompt_chunk_logprobs(logits[: c1 - c0], prompt, c0, top)
                if self.context is not None:
                    self.context.inject(self.drafter, feats, c0 + self._arange_chunk)
            else:
                logits, feats = self._prefill_fn(ids[c0:c1], c0, c1)
                last = logits[-1]
                if scored is not None:
                    scored += prompt_chunk_logprobs(logits, prompt, c0, top)
                if self.context is not None:
                    self.context.inject(self.drafter, feats, c0 + self._arange_chunk[: c1 - c0])
            self.prefill_tokens += c1 - c0
            self._prefilled = c1
        return last

    @torch.inference_mode()
    def rounds(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
               prompt_logprobs: int | None = None, checkpoint: int | None = None) -> Iterator[Round]:
        """Decode until ``max_new_tokens`` tokens have been committed (or the caller stops).

        Args:
            prompt_ids: the prompt's token ids (at least one).
            params: sampling parameters (validated).
            max_new_tokens: upper bound of committed tokens; the last round may commit
                more than needed and the caller cuts.
            prompt_logprobs: None (default: nothing computed) or k in [0, 20]: the prefill
                round's ``prompt_logprobs``, from the logits the prefill computes anyway
                (no extra forward; the same tokens as without).
            checkpoint: None (default) or a position in ``(0, len(prompt_ids)]``: with
                ``reuse_prefix``, where a hybrid or sliding-window model keeps the copy of its
                recurrent states and rings instead of the prompt's end (the prefill stops there
                to take it): e.g. the end of a chat's messages before the template's opening of
                the reply, which the next turn's prompt starts with even where the template
                renders the reply otherwise than it was generated (without its thinking).

        Yields:
            one :class:`Round` for the prefill, then one per decoding round. Each round
            reads the device once (the accepted count and tokens, in one transfer).

        Raises:
            DFlashError: empty prompt, token ids (of the prompt, of ``params``' logit_bias or
                min_tokens_ids) outside the vocabulary, ``params``' min_tokens with min_tokens_ids
                that cover the whole vocabulary, ``params`` not a :class:`SamplingParams`,
                ``max_new_tokens`` not an integer >= 1, a prompt plus ``max_new_tokens``
                longer than the context (where the free memory holds the caches of fewer new tokens
                than the context leaves, the message names that lower figure: :meth:`_check_room`), an
                invalid ``prompt_logprobs`` or ``checkpoint``; growing caches of the prompt +
                ``max_new_tokens`` that do not fit in 90% of the free memory (an
                :class:`~dflash_torch.errors.OptionError` naming ``max_new_tokens``, at the first
                round); and, when the
                generator is resumed, a later ``rounds()`` of this decoder having taken its
                caches (one sequence at a time: use :class:`~dflash_torch.batch.BatchDecoder`
                for several); a call, or a generator's first round, while another generator holds
                the decoder (:meth:`hold`: an engine's open request);
                a call, or a round (each ``next()``, refused without ending the generator), from
                another thread while the compute thread runs an engine call
                (:func:`~dflash_torch.compute.check_caller`) or while another thread is inside a
                round of this decoder (a round of the compute thread's own call waits for that
                one instead, up to ``ROUND_WAIT_S`` seconds).
        """
        compute.check_caller("SpeculativeDecoder.rounds")
        check_prompt_logprobs(prompt_logprobs)
        if not isinstance(params, SamplingParams):
            raise DFlashError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_max_new_tokens(max_new_tokens)
        try:
            n_prompt = check_prompt_ids(prompt_ids, self.target.config, max_new_tokens, self.max_context)
        except ContextOptionError as exc:
            if exc.names[0] == "max_new_tokens":  # (past the context: memory may hold fewer than it leaves)
                self._check_room(len(prompt_ids), max_new_tokens, self.max_context - len(prompt_ids))
            raise
        params.check_vocab(self.target.config.vocab_size)
        check_prompt_position(checkpoint, n_prompt, "checkpoint")
        if self._holder is not None:
            raise DFlashError(self._held_message("SpeculativeDecoder.rounds was called"))
        return _Rounds(self, self._decode(prompt_ids, n_prompt, params, max_new_tokens, prompt_logprobs, checkpoint))

    def hold(self, rounds: _Rounds | None, what: str | None = None) -> None:
        """Hold this decoder for ``rounds`` (a generator of :meth:`rounds`; ``what``: the holder in
        words, e.g. "an open request of its DFlashEngine"; None: "another rounds() generator")
        until ``hold(None)``: meanwhile a :meth:`rounds` call, and the first round of another
        generator (which would reset the caches), are refused in words naming ``what``, as a
        round from another thread during an engine call is. ``held_by``: ``what``, None when
        not held."""
        self._holder = rounds
        self.held_by = None if rounds is None else what if what is not None else "another rounds() generator"

    def _held_message(self, head: str) -> str:
        return (f"{head} while {self.held_by} decodes with this decoder, which would take over its caches: wait for it "
                "to end (or close it) first")

    @property
    def takes_checkpoint(self) -> bool:
        """Whether :meth:`rounds`' ``checkpoint`` takes effect: prefix reuse on a hybrid or
        sliding-window model (whose copies it places)."""
        return self.reuse_prefix and self._whole_prefix_only

    def _reusable(self, kept: _Kept | None, prompt: list[int]) -> tuple[int, bool]:
        """Prompt tokens the caches hold (prefix reuse; see ``reuse_prefix``), and whether they
        are those of ``kept``'s prompt, to be restored from its copies: the common start of
        ``prompt`` and ``kept``'s rows, short of the prompt's last token; where the caches
        cannot go back (``_whole_prefix_only``), all of those rows, else ``kept``'s prompt, else none.
        The very same prompt again is reused whole (its last logits are kept)."""
        if kept is None or not self.reuse_prefix:
            return 0, False
        rows = len(kept.tokens) - 1
        same = kept.logits is not None and len(prompt) == kept.prompt_len  # (None: a prefill left midway, see _Kept)
        if same and kept.tokens[: len(prompt)] == prompt:  # the same prompt again
            if not self._whole_prefix_only or rows == len(prompt):
                return len(prompt), False
            if kept.saved_at == len(prompt):
                return len(prompt), True
        n = min(common_start(kept.tokens, prompt), rows, len(prompt) - 1)
        if not self._whole_prefix_only or n == rows:
            return n, False
        if kept.saved is not None and n >= kept.saved_at:
            return kept.saved_at, True
        return 0, False

    def _unwound(self) -> list[torch.Tensor]:
        """The tensors that cannot go back to an earlier position: the rings of the target's
        (and inject mode's drafter's) sliding-window layers, and a hybrid target's recurrent states."""
        caches = [self.target_cache.kv] + ([self.context.cache] if isinstance(self.context, InjectedContext) else [])
        tensors = [t for kv in caches for t, r in zip(kv.k + kv.v, kv.rings + kv.rings) if r is not None]
        state = self.target_cache.recurrent
        return tensors + (state.conv + state.ssm if state is not None else [])

    def _resume(self, kept: _Kept, capacity: int, length: int, restore: bool) -> None:
        """Go on from the caches' first ``length`` positions (room for ``capacity``): first the
        drafter's context gets ``kept``'s pending feature rows (the next propose would have
        injected them), then, with ``restore``, the recurrent states and rings go back to
        ``kept``'s copies (at ``length``, their ``saved_at``)."""
        if kept.pending is not None:
            rows, start = kept.pending
            self.context.inject(self.drafter, rows, start + self._arange_block[: rows.shape[0]])
        if restore:
            for t, saved in zip(self._unwound(), kept.saved):
                t.copy_(saved)
        self.target_cache.resume(capacity, length)
        if self.context is not None:
            self.context.resume(capacity, length)

    def _check_owner(self, run: int) -> None:
        """On resuming the ``rounds()`` generator ``run``: a later one reset the caches it decodes from."""
        if self._run != run:
            raise DFlashError("a later rounds() call on this SpeculativeDecoder took over its caches; it decodes "
                              "one sequence at a time (use a BatchDecoder, or another decoder, for several)")

    @torch.inference_mode()  # (a generator: torch applies it at every resume)
    def _decode(self, prompt_ids: list[int], n_prompt: int, params: SamplingParams, max_new_tokens: int,
                prompt_logprobs: int | None, checkpoint: int | None = None) -> Iterator[Round]:
        self._run += 1
        run = self._run
        B, dev, static = self.block_size, self.device, self.static
        capacity = self.target_cache.capacity if static else n_prompt + max_new_tokens + B + 1
        if capacity > self.target_cache.capacity:  # (refused before the kept rows are let go: they serve the next)
            self._check_room(n_prompt, max_new_tokens)
        kept, self._kept = self._kept, None  # (prefix reuse: see _Kept)
        prompt = list(prompt_ids)
        t0 = time.perf_counter()
        reused, restore = self._reusable(kept, prompt) if prompt_logprobs is None else (0, False)
        self._prefilled = 0
        try:
            if reused:
                self._resume(kept, capacity, reused, restore)
            else:  # fixed shapes: the preallocated buffers stay; recurrent states are zeroed in place
                self.target_cache.reset(capacity)
                if self.context is not None and not static:
                    self.context.reset(capacity)
            self._prefilled = reused
            self.reused_prefill_tokens += reused
            generator = params.generator(dev)

            scored = None if prompt_logprobs is None else []
            copies = self.takes_checkpoint  # (copies of what cannot go back: see _Kept)
            saved, saved_at = None, n_prompt
            if reused == n_prompt:  # the same prompt again
                last_logits = kept.logits
            else:
                ids, start = torch.tensor(prompt, dtype=torch.long, device=dev), reused
                if copies and checkpoint is not None and reused <= checkpoint < n_prompt:  # (the copies there)
                    if reused < checkpoint:
                        self._prefill(ids, checkpoint, scored, prompt, prompt_logprobs or 0, start=reused)
                    saved, saved_at, start = [t.clone() for t in self._unwound()], checkpoint, checkpoint
                last_logits = self._prefill(ids, n_prompt, scored, prompt, prompt_logprobs or 0, start=start)
        except BaseException:  # (a prefill left midway, e.g. by Ctrl-C: the rows it read serve the next request)
            if self.reuse_prefix and not self._whole_prefix_only and self._prefilled > 0:
                end = min(self._prefilled, n_prompt - 1) + 1  # (the rows of all its tokens but the last: see _Kept)
                self._kept = _Kept(prompt[:end], n_prompt, None, n_prompt, None)
            raise
        token, processor = first_token(last_logits, prompt_ids, params, generator)  # (None: nothing processes logits)
        first = int(token)
        logprobs = first_logprobs(last_logits, first, params)
        t1 = time.perf_counter()
        if copies and saved is None:
            saved = [t.clone() for t in self._unwound()]
        if self.reuse_prefix:  # (a copy: a view would hold the whole chunk's logits)
            self._kept = kept = _Kept(prompt + [first], n_prompt, saved, saved_at, last_logits.clone())
        yield Round([first], None, 0.0, t1 - t0, t1 - t0, cached_tokens=reused, logprobs=logprobs,
                    prompt_logprobs=scored, **Round.processed(processor))
        self._check_owner(run)

        s = n_prompt  # position of ``token``: committed, its features not yet known
        s_dev = torch.tensor(s, device=dev)
        committed = 1
        # inject mode: the last verify's feature rows, injected by the next propose (fold);
        # fixed shapes always carry B rows, the first round B zero rows at the block's own
        # positions (the block's K/V overwrite them in the same pass)
        folded = isinstance(self.context, InjectedContext)
        pending, pending_start = None, None
        if folded and static:
            pending = self.drafter.fc.weight.new_zeros(B, self.drafter.fc.in_features)
            pending_start = s_dev.clone()  # not ``s_dev`` itself: aliased inputs would compile a second graph
        while committed < max_new_tokens:
            t0 = time.perf_counter()
            if self._whole_prefix_only:  # (a round left midway, e.g. by Ctrl-C, may have moved them)
                self._kept = None
            pos = s_dev if static else s
            kv_len = self.kv_bucket(s + B) if static else s + B
            draft_probs = None
            if B > 1:
                scores = self._draft_fn(token, pos, kv_len, pending, pending_start)
                if processor is not None:  # (logit bias, min_tokens, grammar: see LogitsProcessor.choose_draft)
                    draft, draft_probs = processor.choose_draft(self.drafter, scores, params, generator)
                else:
                    draft, draft_probs = self.drafter.choose_draft(scores, params, generator)
                block = torch.cat([token.view(1), draft])
            else:
                block = token.view(1)
            self._sync()
            t1 = time.perf_counter()
            logits, feats = self._verify_fn(block, pos, kv_len)
            scores = logits  # (logprobs are of the raw logits)
            if processor is not None:  # row j follows the drafts before it (see sampling.LogitsProcessor)
                scores = processor.apply(logits, block[1:])
            limit = processor.draft_limit if processor is not None else None
            if B == 1:
                a_dev, bonus = torch.zeros((), dtype=torch.long, device=dev), choose(scores, params, generator)[0]
            elif params.greedy:
                a_dev, bonus = accept_greedy(block[1:], scores, limit)
            else:
                a_dev, bonus = accept_sampling(block[1:], draft_probs, probabilities(scores, params), generator, limit)
            out = torch.cat([a_dev.view(1).to(block.dtype), block[1:], bonus.view(1)]).tolist()  # the one host sync
            a = out[0]
            tokens = out[1:a + 1] + [out[-1]]
            logprobs = None  # (before the commit: a CUDA graph's replay may reuse the logits' memory)
            if params.logprobs is not None:
                logprobs = token_logprobs(logits[:a + 1], tokens, params.logprobs)
            if processor is not None:
                processor.commit(tokens)
            t2 = time.perf_counter()
            if folded:  # all B rows with fixed shapes: rows past the accepted ones are overwritten next round
                pending, pending_start = (self._carry(feats), s_dev) if static else (feats[: a + 1], s)
            elif self.context is not None:
                self.context.inject(self.drafter, feats[: a + 1], s + self._arange_block[: a + 1])
            self.target_cache.length = s + a + 1  # rollback: rows past the accepted prefix are stale
            if self.defer_commit:
                self._commit_fn(a_dev + 1)
            self._sync()
            t3 = time.perf_counter()
            if self.reuse_prefix:  # (in this order: a round left midway keeps the last yield's rows)
                kept.pending = (pending[: a + 1], s) if folded else None
                kept.tokens += tokens
                self._kept = kept
            s += a + 1
            s_dev = s_dev + (a_dev + 1)
            committed += a + 1
            token = bonus
            yield Round(tokens, a + 1, t1 - t0, t2 - t1, t3 - t0, logprobs=logprobs,
                        **Round.processed(processor))
            self._check_owner(run)
