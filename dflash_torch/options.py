"""One validation for each option that several commands and the Python API share.

``generate``, ``serve``, ``bench`` and ``train`` (where they take the option), the
Python API (:meth:`DFlashEngine.from_pretrained`, :meth:`DFlashEngine.stream`,
:func:`dflash_torch.compute.set_num_threads`, :func:`dflash_torch.serving.create_app`)
and the server check these values here and nowhere else. Each function returns the
normalised value or raises :class:`~dflash_torch.errors.OptionError` (a :class:`DFlashError`)
with one line; ``name`` is how the caller spells the option (``--threads`` on the command
line, ``threads`` in Python). The command line names its flag in the message of an
``OptionError`` raised under the Python name (``max_new_tokens`` -> ``--max-new-tokens``;
see :func:`dflash_torch.cli.main`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

import torch

from .errors import ContextOptionError, DFlashError, OptionError, shown

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAVE_DTYPES = {**SUPPORTED_DTYPES, "float16": torch.float16}  # (a trained drafter's weights: storage, not compute)
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
MIN_CONTEXT = 2  # one prompt token and one generated token


def readable(tensor: torch.Tensor, subject: str, name: str | None = None, holds: bool = False) -> torch.Tensor:
    """``tensor``, whose values can be read (``.tolist()``, ``.item()``): not a meta tensor
    (a shape and a dtype, no values) nor a sparse one (which they refuse: torch raised
    "Cannot copy out of meta tensor" or "Cannot access data pointer ..." at the caller).
    ``subject``: the words that name it in a message (``the prompt``); ``holds``: it is
    an item of that value, not the value itself.

    Raises:
        OptionError: such a tensor, naming ``name`` (a :class:`DFlashError` without one)."""
    what = "a meta tensor (a shape and a dtype, no values): make it on a real device (cpu, cuda)" if tensor.is_meta \
        else f"a sparse tensor ({tensor.layout}): pass its .to_dense()" if tensor.layout != torch.strided \
        and str(tensor.layout).startswith("torch.sparse") else None
    if what is not None:
        message = f"{subject} {'holds' if holds else 'is'} {what}"
        raise OptionError(message, name) if name else DFlashError(message)
    return tensor


def plain(value, name: str | None = None, _item: bool = False):
    """``value`` with NumPy and torch scalars and arrays made Python values (``np.int64(4)``
    -> ``4``, ``np.float32(0.9)`` or ``torch.tensor(0.9)`` -> ``0.9``, ``np.True_`` ->
    ``True``, an array or tensor -> a list), in lists, tuples and dict keys and values too;
    anything else as it is. The engine's options are checked as Python values: NumPy's and
    torch's are the same numbers (a 0-dim tensor was "must be a finite number, got
    tensor(0.5000)"). ``name``: the option's, which an error names.

    Raises:
        OptionError: a tensor without values to read, meta or sparse (:func:`readable`)."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        readable(value, name or "the value", name, holds=_item)
        return value.item() if value.ndim == 0 else value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v, name, True) for v in value)
    if isinstance(value, dict):
        return {plain(k, name, True): plain(v, name, True) for k, v in value.items()}
    return value


def strict_json(text: str):
    """``json.loads`` of ``text`` as strict JSON: ``NaN``, ``Infinity`` and ``-Infinity``
    (which Python's parser takes, JSON has not) are refused; a number beyond a float's
    range (``1e400``, valid JSON) is read as Python reads it.

    Raises:
        ValueError: text that is not JSON (RecursionError: nested too deeply to read)."""
    def constant(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=constant)


def non_finite(value) -> bool:
    """Whether ``value`` (a dict or list, walked without recursion) holds a float NaN or
    infinity, which JSON cannot write (``json.dumps`` writes ``NaN`` / ``Infinity``)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return False


def json_type(value) -> str:
    """The JSON type of a value, in words (``an object``, ``an array``, ``a string``,
    ``a number``, ``a boolean``, ``null``); a value of no JSON type: its Python type's name."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    for kind, words in ((str, "a string"), (dict, "an object"), ((list, tuple), "an array")):
        if isinstance(value, kind):
            return words
    return type(value).__name__


ROWS_HINT = "generate_batch(list(ids)) takes its rows as prompts, each without its padding"  # (of an [N, L] batch of ids)


def tokenizer_output_hint(value, batch: bool = False) -> str:
    """How to pass a tokenizer's output (a ``BatchEncoding``, ``tokenizer(text)``, or any
    mapping of ``input_ids``) as :meth:`DFlashEngine.generate`'s prompt (``batch``: as
    :meth:`DFlashEngine.generate_batch`'s prompts): its ``["input_ids"]`` (its row of a
    ``[1, N]`` batch; of ``[N, L]``, the rows to ``generate_batch``); ``""`` for anything else."""
    if not callable(getattr(value, "keys", None)) or "input_ids" not in value.keys():
        return ""
    ids = value["input_ids"]
    rows = len(ids) if getattr(ids, "ndim", 1) == 2 or (isinstance(ids, list) and ids and isinstance(ids[0], list)) else 0
    got = f"a tokenizer's output ({type(value).__name__})"
    if batch:
        how = ('pass the rows of its ["input_ids"] as a list, each without its padding' if rows else
               'its ["input_ids"] is one prompt, for generate')
    elif rows > 1:
        how = f'its ["input_ids"] holds {rows} prompts: pass its rows to generate_batch as a list, each without its padding'
    else:
        how = 'pass its ["input_ids"][0] (a batch of one)' if rows else 'pass its ["input_ids"]'
    return f", got {got}: {how}"


def as_prompt(prompt):
    """A prompt as :meth:`DFlashEngine.encode_prompt` reads it: a tuple or ``range`` as a list,
    a 1-D integer tensor or NumPy array of token ids as a list of ints; anything else as it is.

    Raises:
        DFlashError: a tensor or array that is not 1-D (the message says how to pass one
            row of a ``[1, N]`` batch, or the rows of an ``[N, L]`` one to
            :meth:`DFlashEngine.generate_batch`), or not of integers; a meta or sparse
            tensor (or one such among the ids), whose values cannot be read (:func:`readable`).
    """
    import numpy as np

    if isinstance(prompt, (list, tuple)):
        for t in prompt:
            if isinstance(t, torch.Tensor):  # (0-dim ids)
                readable(t, "the prompt", "prompt", holds=True)
    if isinstance(prompt, (tuple, range)):
        return list(prompt)
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(prompt, torch.Tensor) else "array"
        if kind == "tensor":
            readable(prompt, "the prompt", "prompt")
        if prompt.ndim != 1:
            hint = ""
            if prompt.ndim == 2 and len(prompt) == 1:
                hint = " (a batch of one, e.g. a tokenizer's input_ids: pass its row, ids[0])"
            elif prompt.ndim == 2 and len(prompt) > 1:
                hint = f" ({len(prompt)} prompts: {ROWS_HINT})"
            raise DFlashError(f"a prompt {kind} of token ids must be 1-D, got shape {tuple(prompt.shape)}{hint}")
        integer = not (prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool) \
            if kind == "tensor" else np.issubdtype(prompt.dtype, np.integer)
        if not integer:
            raise DFlashError(f"prompt token ids must be integers, got {'a tensor' if kind == 'tensor' else 'an array'} "
                              f"of {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    return prompt


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(value, name: str, minimum: int = 1) -> int:
    """A count: an integer >= ``minimum`` (a NumPy integer too, returned as a Python int)."""
    value = plain(value, name)
    if not _is_int(value) or value < minimum:
        raise OptionError(f"{name} must be an integer >= {minimum}, got {shown(value)}", name)
    return value


def usable_cpus() -> int | None:
    """The CPUs this process may use: those of its CPU affinity (``os.sched_getaffinity``:
    ``taskset``, a container's cpuset), where the system tells them, else ``os.cpu_count()``
    (None: unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        return os.cpu_count()


def check_threads(value, name: str = "threads") -> int:
    """CPU threads for torch: an integer in [1, :func:`usable_cpus`] (threads beyond the
    CPUs this process may use only contend for them); >= 1 where that count is unknown."""
    value = plain(value, name)
    cpus = usable_cpus()
    if cpus is None:
        return check_count(value, name)
    if not _is_int(value) or not 1 <= value <= cpus:
        raise OptionError(f"{name} must be an integer from 1 to the CPUs this process may use ({cpus}), "
                          f"got {shown(value)}", name)
    return value


def target_context(config) -> tuple[int, str]:
    """The longest context the target ``config`` (a :class:`~dflash_torch.models.config.TargetConfig`)
    runs, in tokens, and where that number comes from (for messages).

    ``max_position_embeddings``; for a YaRN rule with a ``factor``, the larger of that and
    ``original_max_position_embeddings`` (default ``max_position_embeddings``, as YaRN's
    frequencies read it) x ``factor``: YaRN stretches the pre-training context by its factor
    (as vLLM derives its maximum length), and a config may keep ``max_position_embeddings``
    as shipped when it adds the rule (the Qwen3 model cards' recipe). A linear rule
    (position interpolation) stretches ``max_position_embeddings`` by its factor, as vLLM
    reads it (e.g. a 4096-position model with factor 4 runs 16,384 tokens). llama3 rules
    leave it at ``max_position_embeddings`` (llama3 configs state the extended length there;
    vLLM does not stretch them either). The RoPE itself still reads
    ``max_position_embeddings``, as transformers does.
    """
    limit = config.max_position_embeddings
    scaling = config.rope_scaling or {}
    kind, factor = scaling.get("rope_type"), scaling.get("factor")
    if kind in ("yarn", "linear") and factor is not None:
        original = (scaling.get("original_max_position_embeddings") if kind == "yarn" else None) or limit
        stretched = int(original * factor)
        if stretched > limit:
            name = "original_max_position_embeddings" if kind == "yarn" else "max_position_embeddings"
            return stretched, f"{'YaRN' if kind == 'yarn' else 'linear'} factor {factor} x {name} {original}"
    return limit, "max_position_embeddings"


def context_limit(config) -> int:
    """The target's context in tokens (:func:`target_context`)."""
    return target_context(config)[0]


def check_max_context(value, config, name: str = "max_context") -> int:
    """Longest prompt + generation in tokens: None (the target's context,
    :func:`target_context` of its ``config``) or an integer in [2, that] (a prompt token
    and a generated token need 2; a NumPy integer too, returned as a Python int); returns
    the value, the target's context for None."""
    limit, source = target_context(config)
    value = plain(value, name)
    if value is not None and (not _is_int(value) or not MIN_CONTEXT <= value <= limit):
        raise OptionError(f"{name} must be an integer in [{MIN_CONTEXT}, {limit}] (the target's "
                          f"context: {source}), got {shown(value)}", name)
    return limit if value is None else value


def check_prompt_ids(prompt_ids: list[int], config, max_new_tokens: int, max_context: int) -> int:
    """A prompt's token ids for a decoding of ``max_new_tokens`` within ``max_context``
    tokens, on the target of ``config`` (a :class:`~dflash_torch.models.config.TargetConfig`:
    its vocabulary and context); returns the prompt's length (tokens).

    Raises:
        DFlashError: a prompt that is not a list of integers (Python or NumPy integers,
            0-dim integer tensors; not bools), an empty prompt, ids outside ``[0, vocab_size)``,
            a prompt of ``max_context`` tokens or more (no room for a new token: an
            :class:`OptionError` naming the prompt, and ``max_context`` where a larger one, up
            to the target's context, would hold it), or prompt plus ``max_new_tokens``
            beyond ``max_context`` (one naming ``max_new_tokens``).
    """
    if not isinstance(prompt_ids, list):  # (the step-level APIs; the engine's calls take tuples, ranges, tensors)
        raise DFlashError(f"prompt token ids must be a list of integers, got a {type(prompt_ids).__name__} "
                          "(convert it with list(...), or .tolist() for a tensor)")
    if any(isinstance(t, bool) or not hasattr(t, "__index__") for t in prompt_ids):
        what = prompt_ids if isinstance(prompt_ids, (str, list)) and len(prompt_ids) <= 8 else type(prompt_ids).__name__
        raise DFlashError(f"prompt token ids must be integers, got {shown(what)}")
    vocab_size = config.vocab_size
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise DFlashError("the prompt is empty (0 tokens)")
    if any(not 0 <= t.__index__() < vocab_size for t in prompt_ids):
        raise DFlashError(f"prompt token ids must be in [0, {vocab_size})")
    if n_prompt >= max_context:  # (lowering max_new_tokens cannot help)
        limit = context_limit(config)
        if n_prompt < limit:  # (a longer max_context would hold it: with max_new_tokens, or with fewer)
            fewer = "" if n_prompt + max_new_tokens <= limit else " with fewer max_new_tokens"
            raise ContextOptionError(f"the prompt ({n_tokens(n_prompt)}) leaves no room for a new token in the context of "
                                     f"{max_context} tokens; shorten it or raise max_context (up to {limit}){fewer}",
                                     "prompt", "max_context", "max_new_tokens")
        context = "the target's context" if max_context == limit else "the context"
        beyond = "" if max_context == limit else f" (the target's context is {limit} tokens)"
        raise ContextOptionError(f"the prompt ({n_tokens(n_prompt)}) leaves no room for a new token in {context} of "
                                 f"{max_context} tokens; shorten it{beyond}", "prompt")
    if n_prompt + max_new_tokens > max_context:
        limit = context_limit(config)
        left = max_context - n_prompt
        raise ContextOptionError(f"prompt ({n_tokens(n_prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the context "
                                 f"of {max_context} tokens; ask for at most {left} new token{'s' * (left != 1)}"
                                 + (f", or raise max_context (up to {limit})" if max_context < limit else ""),
                                 "max_new_tokens", "max_context")
    return n_prompt


def n_tokens(n: int) -> str:
    """``"1 token"``, ``"5 tokens"``: a count of tokens for a message."""
    return f"{n} token{'' if n == 1 else 's'}"


def check_min_tokens_default(min_tokens, default: int, name: str = "max_new_tokens", whose: str = "") -> None:
    """Refuse a ``min_tokens`` above ``default``, the length that applies where a request
    gives none (named as such: the default is no value the caller gave); ``name``: how the
    caller spells the length, ``whose``: where the default comes from (", generation_config.json's").

    Raises:
        OptionError: naming ``min_tokens`` and ``name``.
    """
    if _is_int(min_tokens) and min_tokens > default:
        raise OptionError(f"min_tokens ({min_tokens}) exceeds the default {name} ({default}{whose}), which applies "
                          "where none is given", "min_tokens", name)


def check_min_tokens_room(min_tokens: int, n_prompt: int, max_context: int) -> int:
    """The tokens a prompt of ``n_prompt`` tokens leaves in ``max_context``, where a request
    gave no length (its default is cut to them).

    Raises:
        OptionError: a ``min_tokens`` above them, named so.
    """
    room = max_context - n_prompt
    if min_tokens > room:
        raise ContextOptionError(f"min_tokens ({min_tokens}) exceeds the {room} tokens left in the context of {max_context} "
                                 f"tokens after the prompt ({n_tokens(n_prompt)})", "min_tokens")
    return room


def check_block_size(value, trained: int | None, name: str = "block size", context: int | None = None) -> int | None:
    """Tokens per draft block: None (the drafter's ``trained`` block size) or an integer in
    [1, trained]; ``trained`` None means target-only decoding, where only None or 1 fit (a
    NumPy integer too, returned as a Python int). The block that runs (``value``, else
    ``trained``) must be at most ``context`` tokens, the target's (:func:`context_limit`;
    None: not checked): no longer block fits, and its buffers are sized by it (a drafter
    config.json block_size of 10**12 allocated terabytes).

    Raises:
        OptionError: ``value`` out of range, or longer than ``context``.
        DFlashError: no ``value``, and ``trained`` longer than ``context`` (no option names it)."""
    value = plain(value, name)
    if trained is None:
        if value not in (None, 1) or isinstance(value, bool):
            raise OptionError(f"{name} {value!r} needs a drafter (target-only decoding commits one token per step)",
                              name)
        return value
    if value is not None and (not _is_int(value) or not 1 <= value <= trained):
        raise OptionError(f"{name} must be an integer in [1, {trained}] (the drafter's trained block size), "
                          f"got {shown(value)}", name)
    block = trained if value is None else value
    if context is not None and block > context:
        if value is None:  # (no option given: the message names none as given)
            raise DFlashError(f"the drafter's trained block size, its config.json block_size {shown(block)}, is longer "
                              f"than the target's context of {context} tokens; give a {name} of at most {context}")
        raise OptionError(f"{name} {shown(block)} is longer than the target's context of {context} tokens; "
                          f"give a {name} of at most {context}", name)
    return value


def resolve_dtype(value: str | torch.dtype, name: str = "dtype", device: str | torch.device | None = None) -> torch.dtype:
    """A dtype name (``float32``, ``bfloat16``, an alias such as ``bf16``, or ``auto``) or
    torch dtype. ``auto`` is bfloat16 on a CUDA ``device`` (the published checkpoints'
    dtype: half the memory of float32 and the GPU's fast path) and float32 elsewhere (on
    CPUs without bfloat16 units float32 is the fast dtype; it is also the exact one).

    Raises:
        DFlashError: float16 (its range overflows in these models' activations on CPU;
            use bfloat16) and any other unsupported value.
    """
    value, key = _dtype_key(value, name)
    if key == "auto":
        return torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else torch.float32
    if key == "float16":
        raise OptionError(f"{name} float16 is not supported (activations can overflow); use bfloat16 or float32", name)
    if key not in SUPPORTED_DTYPES:
        raise OptionError(f"unsupported {name} {value!r}; choose one of auto, {', '.join(SUPPORTED_DTYPES)}", name)
    return SUPPORTED_DTYPES[key]


def resolve_save_dtype(value: str | torch.dtype, name: str = "save_dtype") -> torch.dtype:
    """The dtype a trained drafter's weights are saved in: ``bfloat16``, ``float32`` or
    ``float16`` (a name in any case, an alias such as ``bf16`` or ``half``, or a torch dtype);
    ``auto`` is float32. Storage only: float16 weights load into the engine's own dtype (it
    refuses float16 to compute in, not to read, see :func:`resolve_dtype`).

    Raises:
        OptionError: any other value.
    """
    value, key = _dtype_key(value, name)
    if key == "auto":
        return torch.float32
    if key not in SAVE_DTYPES:
        raise OptionError(f"unsupported {name} {value!r}; choose one of auto, {', '.join(SAVE_DTYPES)}", name)
    return SAVE_DTYPES[key]


def _dtype_key(value, name: str) -> tuple[str, str]:
    """``value`` (a dtype name or torch dtype) as a name, and the key it stands for:
    lowercase, without ``torch.``, an alias resolved (``BF16`` -> ``bfloat16``).

    Raises:
        OptionError: ``value`` neither a str nor a torch dtype."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if not isinstance(value, str):
        raise OptionError(f"{name} must be a name such as 'float32' or 'bfloat16', got {shown(value)}", name)
    key = value.strip().lower().removeprefix("torch.")  # (str(torch.float32) names it so)
    return value, _DTYPE_ALIASES.get(key, key)


def resolve_device(value: str | torch.device, name: str = "device") -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` (CUDA must be available), a name in any case (``CPU``,
    as :func:`resolve_dtype` takes ``BF16``), or a torch device. ``cpu:0`` is ``cpu``.

    Raises:
        OptionError: another device type, a CUDA device this machine lacks, or a CPU index
            other than 0 (torch runs every CPU as one device and ignored it: ``cpu:99`` ran).
    """
    if not isinstance(value, (str, torch.device)):
        raise OptionError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {shown(value)}", name)
    try:
        dev = torch.device(value.strip().lower() if isinstance(value, str) else value)
    except RuntimeError:
        raise OptionError(f"invalid {name} {value!r}; use cpu, cuda or cuda:N", name) from None
    if dev.type not in ("cpu", "cuda"):
        raise OptionError(f"unsupported {name} {value!r}; use cpu or cuda", name)
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise OptionError(f"{name} {value!r}: torch runs all the CPUs as one device; use cpu (or cpu:0)", name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"{name} {value!r} requested but CUDA is not available", name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OptionError(f"{name} {value!r}: there are {torch.cuda.device_count()} CUDA device(s)", name)
    return dev


def check_api_key(value: str | None, name: str = "api_key") -> str | None:
    """An API key without its surrounding whitespace (a key read from a file keeps its
    newline); None means no key. It must be visible ASCII (an HTTP header carries it)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise OptionError(f"{name} must be a string, got {type(value).__name__}", name)
    key = value.strip()
    if not key:
        raise OptionError(f"{name} must not be empty", name)
    if not all("!" <= c <= "~" for c in key):
        raise OptionError(f"{name} must be printable ASCII without spaces (it is sent in an HTTP header)", name)
    return key


def check_strings(value, name: str) -> list[str]:
    """A list of strings (a server's CORS origins, methods or headers), as a list.

    Raises:
        OptionError: not a list (or tuple) of strings."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise OptionError(f"{name} must be a list of strings, e.g. [\"*\"], got {str(value)[:80]}", name)
    return list(value)


def check_model_name(value: str | None, name: str = "model_name") -> str | None:
    """The model id a server serves: None (the default name) or a non-blank string.

    Raises:
        OptionError: a value that is not a string, or an empty / blank one.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise OptionError(f"{name} must be a string, got {type(value).__name__}", name)
    if not value.strip():
        raise OptionError(f"{name} must not be empty", name)
    return value


def check_stop(value: str | Sequence[str] | None, name: str = "stop") -> list[str]:
    """Stop strings: a non-empty string or a list of them; None means none."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise OptionError(f"{name} must be a string or a list of strings", name)
    if any(s == "" for s in value):
        raise OptionError(f"{name} strings must not be empty", name)
    return list(value)


def check_stop_token_ids(value: int | Sequence[int] | None, vocab_size: int, name: str = "stop token ids") -> list[int]:
    """Stop token ids: an id or a list of ids in [0, vocab_size) (a tuple, set or ``range``, a
    NumPy or torch integer, a 1-D array or tensor of them too, as a prompt's ids are taken);
    None means none."""
    if value is None:
        return []
    value = plain(list(value) if isinstance(value, range) else value, name)
    if _is_int(value):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(_is_int(t) for t in value):
        raise OptionError(f"{name} must be an integer or a list of integers, got {shown(value)}", name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise OptionError(f"{name} must be in [0, {vocab_size}) (the vocabulary), got {bad[0]}", name)
    return list(value)


def check_flag(value, name: str) -> bool:
    """A yes/no option: True or False (a truthy string such as "false" would read as True)."""
    if not isinstance(value, bool):
        raise OptionError(f"{name} must be True or False, got {shown(value)}", name)
    return value


def check_max_new_tokens(value, name: str = "max_new_tokens") -> int:
    """Generated tokens: an integer >= 1."""
    return check_count(value, name)


def check_prompt_logprobs(value, name: str = "prompt_logprobs") -> int | None:
    """Log-probabilities of the prompt's tokens (vLLM's ``prompt_logprobs``): None (off) or
    the number of most likely alternatives per position, an integer in [0, 20] (the range of
    ``logprobs``, :data:`~dflash_torch.sampling.MAX_LOGPROBS`)."""
    from .sampling import MAX_LOGPROBS  # (sampling imports this module's neighbours; late to keep imports acyclic)

    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise OptionError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {shown(value)}"
                          + (" (the number of most likely tokens reported at each prompt position; 0: the prompt "
                             "token's log-probability alone)") * isinstance(value, bool), name)
    return value


def check_prompt_position(value, prompt_tokens: int, name: str, counted: bool = False) -> int | None:
    """None or an integer position in ``(0, prompt_tokens]`` of a prompt: where a chat's
    messages end (``DFlashEngine.stream``'s ``history_end``, the decoders' ``checkpoint``), or its leading
    system messages (the batch decoder's ``shared_end``).
    ``counted``: the message says how many tokens the prompt has."""
    if value is not None and (not _is_int(value) or not 0 < value <= prompt_tokens):
        where = f"the prompt's {prompt_tokens} tokens, " if counted else ""
        raise OptionError(f"{name} must be None or a position in {where}(0, {prompt_tokens}], got {shown(value)}", name)
    return value


def check_choice(value, choices: tuple[str, ...], name: str) -> str:
    """``value`` when it is one of ``choices``.

    Raises:
        OptionError: any other value (``{name} must be one of a, b, got 'x'``).
    """
    if value not in choices:
        raise OptionError(f"{name} must be one of {', '.join(choices)}, got {shown(value)}", name)
    return value


MXFP4_MODES = FP8_MODES = INT_WEIGHTS_MODES = NVFP4_MODES = ("auto", "dequantize", "packed")  # how to hold quantized weights


def check_mxfp4(value, has_mxfp4: bool | None = None, name: str = "mxfp4") -> str:
    """How to hold MXFP4 expert weights (gpt-oss): one of :data:`MXFP4_MODES`;
    ``"packed"`` only for a checkpoint that has them (``has_mxfp4``; None: not known yet).

    Raises:
        OptionError: any other value, or ``"packed"`` for a checkpoint without MXFP4 weights.
    """
    return _check_packing(value, has_mxfp4, name, "keeps MXFP4 expert weights packed", "")


def check_fp8(value, has_fp8: bool | None = None, name: str = "fp8", has_mxfp4: bool = False) -> str:
    """How to hold the weights of a fine-grained FP8 checkpoint: one of :data:`FP8_MODES`;
    ``"packed"`` only for a checkpoint that has them (``has_fp8``; None: not known yet; the
    message points a checkpoint with MXFP4 weights, ``has_mxfp4``, to ``mxfp4``).

    Raises:
        OptionError: any other value, or ``"packed"`` for a checkpoint without FP8 weights.
    """
    why = ("its weights are MXFP4: see mxfp4; " if has_mxfp4 else
           "its config.json has no quantization_config with quant_method 'fp8'; ")
    return _check_packing(value, has_fp8, name, "keeps FP8 weights as stored", why, *(("mxfp4",) if has_mxfp4 else ()))


def check_int_weights(value, has_int: bool | None = None, name: str = "int_weights") -> str:
    """How to hold the packed integer weights of a compressed-tensors W4A16 / W8A16
    checkpoint: one of :data:`INT_WEIGHTS_MODES`; ``"packed"`` only for a checkpoint that has
    them (``has_int``; None: not known yet).

    Raises:
        OptionError: any other value, or ``"packed"`` for a checkpoint without them.
    """
    return _check_packing(value, has_int, name, "keeps packed integer weights packed",
                          "its config.json has no quantization_config with quant_method 'compressed-tensors' "
                          "and format 'pack-quantized'; ")


def check_nvfp4(value, has_nvfp4: bool | None = None, name: str = "nvfp4", fp8_only: bool = False) -> str:
    """How to hold the NVFP4 weights of a compressed-tensors ``nvfp4-pack-quantized`` or
    ModelOpt NVFP4 / MIXED_PRECISION checkpoint: one of :data:`NVFP4_MODES`; ``"packed"`` only
    for a checkpoint that has them (``has_nvfp4``; None: not known yet; ``fp8_only``: the
    checkpoint is ModelOpt per-tensor FP8, which is always dequantized, and the message says so).

    Raises:
        OptionError: any other value, or ``"packed"`` for a checkpoint without NVFP4 weights.
    """
    why = ("its weights are ModelOpt per-tensor FP8, dequantized when loading; " if fp8_only else
           "its config.json declares no NVFP4 weights (compressed-tensors 'nvfp4-pack-quantized', ModelOpt "
           "'NVFP4' or 'MIXED_PRECISION' with NVFP4 layers); ")
    return _check_packing(value, has_nvfp4, name, "keeps NVFP4 weights packed", why)


def _check_packing(value, present: bool | None, name: str, packed: str, why: str, *others: str) -> str:
    check_choice(value, MXFP4_MODES, name)
    if value == "packed" and present is False:
        raise OptionError(f"{name} packed {packed}, but the target checkpoint has none ({why}use auto or dequantize)",
                          name, *others)
    return value


def check_keepalive(value, name: str = "sse_keepalive") -> float:
    """Seconds between SSE keep-alive comments: a finite number >= 0 (0: none), as a float.

    Raises:
        OptionError: any other value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise OptionError(f"{name} must be a number of seconds >= 0 (0 = no keep-alive), got {shown(value)}", name)
    return float(value)


def check_body_timeout(value, name: str = "body_timeout") -> float:
    """Seconds a request's body may take to arrive whole, from its headers: a finite number
    >= 0 (0: no limit), as a float.

    Raises:
        OptionError: any other value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise OptionError(f"{name} must be a number of seconds >= 0 (0: no limit), got {shown(value)}", name)
    return float(value)


def check_chat_template_kwargs(value, reserved: Sequence[str] = (), name: str = "chat_template_kwargs") -> dict | None:
    """Extra variables for the tokenizer's chat template (e.g. ``{"enable_thinking": False}``
    for Qwen3 / Qwen3.5, ``{"reasoning_effort": "low"}`` for gpt-oss): None or a dict with
    string keys, none of them in ``reserved`` (the template call's own arguments, such as
    ``add_generation_prompt`` or ``chat_template``, which would change how it is called).

    Raises:
        OptionError: anything else.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise OptionError(f"{name} must be an object (a dict) with string keys, got {shown(value)}", name)
    taken = sorted(set(value) & set(reserved))
    if taken:
        raise OptionError(f"{name} cannot set {', '.join(taken)} (an argument of the chat template call itself)", name)
    return dict(value)


def tool_name_error(name: str) -> str | None:
    """What is wrong with a function's ``name`` (a string) as a tool's, in words, or None: a
    name a call can give is any string but an empty or blank one (others are taken as sent,
    as vLLM takes them). The one rule of :func:`check_tools` and of the server's ``tools``."""
    if not name.strip():
        return f"a function needs a name its calls can give, got {'an empty string' if not name else 'blanks'}"
    return None


TOOL_FORM = "a tool is {'type': 'function', 'function': {'name': str, 'description': str, 'parameters': dict}}"


def _check_tool(tool: dict, where: str, name: str) -> None:
    """One tool of :func:`check_tools` (``where``: ``tools[i]``): OpenAI's form, as the server's
    request model takes it (``type`` "function", ``function`` a dict with a ``name`` string,
    :func:`tool_name_error`, and a ``description`` string or None)."""
    def fail(what: str):
        raise OptionError(f"{where}{what}"[:300], name)

    if "type" not in tool:
        fail(f".type is missing; {TOOL_FORM}")
    if tool["type"] != "function":
        fail(f".type must be 'function', got {shown(tool['type'])}; {TOOL_FORM}")
    if "function" not in tool:
        fail(f".function is missing; {TOOL_FORM}")
    fn = tool["function"]
    if not isinstance(fn, dict):
        fail(f".function must be an object (a dict), got {shown(fn)}; {TOOL_FORM}")
    if "name" not in fn:
        fail(".function.name is missing")
    if not isinstance(fn["name"], str):
        fail(f".function.name must be a string, got {shown(fn['name'])}")
    if (problem := tool_name_error(fn["name"])) is not None:
        fail(f".function.name: {problem}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        fail(f".function.description must be a string, got {shown(fn['description'])}")


def check_tools(value, name: str = "tools") -> list[dict] | None:
    """The functions a chat may call (OpenAI's ``tools``: ``[{"type": "function",
    "function": {"name", "description", "parameters"}}]``, passed to the chat template):
    None, or a list of dicts (an empty list is None).

    Raises:
        OptionError: anything else (a tool without ``type`` "function", without a
            ``function`` dict, a function without a ``name`` string or with an empty or blank
            one, :func:`tool_name_error`, a ``description`` that is not a string), a
            function's ``parameters`` that are not the JSON Schema of an object, or two
            different functions of one name (a call of it could mean either; the same
            definition twice is taken).
    """
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, dict) for t in value):
        raise OptionError(f"{name} must be a list of objects (dicts), got {shown(value)}"[:300], name)
    named: dict[str, int] = {}  # function name -> the index of its first tool
    for i, tool in enumerate(value):
        _check_tool(tool, f"{name}[{i}]", name)
        fn = tool["function"]
        if fn.get("parameters") is not None:
            _check_parameters(fn["parameters"], f"{name}[{i}].function.parameters", name)
        first = named.setdefault(fn["name"], i)
        if _unset_dropped(value[first]) != _unset_dropped(tool):
            raise OptionError(f"{name}[{first}] and {name}[{i}] are two different functions named {fn['name']!r}"[:300]
                              + ": a call of it could mean either; give each its own name", name)
    return list(value)


def _unset_dropped(tool: dict) -> dict:
    """``tool`` without its null fields, and its ``function``'s (``"strict": null`` is what a client
    that fills in defaults sends beside a copy without it: the same definition)."""
    fn = tool.get("function")
    kept = {k: v for k, v in tool.items() if v is not None}
    if isinstance(fn, dict):
        kept["function"] = {k: v for k, v in fn.items() if v is not None}
    return kept


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _check_parameters(params, where: str, name: str) -> None:
    """A function's ``parameters``: a JSON Schema of an object, as OpenAI requires
    (``type`` "object" where given; ``properties`` an object of schemas with valid
    ``type`` names; ``required`` a list of names), so a malformed one is refused naming
    it, not left to the chat template or the tool-call grammar."""
    def fail(what: str):
        raise OptionError(f"{where}{what}"[:300], name)

    if not isinstance(params, dict):
        fail(f" must be a JSON Schema object, got {shown(params)}")
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        fail(f" must be the JSON Schema of an object (type \"object\"), got type {params['type']!r}")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        fail(f".properties must be an object of parameter schemas, got {shown(props)}")
    for key, schema in props.items():
        if not isinstance(schema, (dict, bool)):
            fail(f".properties.{key} must be a JSON Schema (an object), got {shown(schema)}")
        kinds = schema.get("type") if isinstance(schema, dict) else None
        if kinds is not None and not all(k in JSON_TYPES for k in (kinds if isinstance(kinds, list) else [kinds])):
            fail(f".properties.{key}.type must name JSON types ({', '.join(JSON_TYPES)}), got {shown(kinds)}")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        fail(f".required must be a list of parameter names, got {shown(required)}")
