"""The ``dflash-torch`` command line.

Subcommands: ``generate`` (here), and the ones registered by their own modules
(``chat``, ``serve``, ``train``, ``bench``). A user error prints one line to stderr and exits 2;
output that stdout cannot take (closed, a full disk) one line and exits 1 (a reader that went
away, a broken pipe, ends the command quietly), as does a failure to build ``--compile``'s graphs
(:class:`~dflash_torch.errors.CompileError`: torch's reason, and what to do where it tells);
lines that stderr cannot take (closed, a full disk) are dropped, and the command goes on;
an error about an option's value names the option as the user typed it (``--max-new-tokens``),
not as the Python API spells it (``max_new_tokens``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import signal
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from .aliases import flag_hint
from .errors import CompileError, ContextLengthError, DFlashError, OptionError, OutputError, first_line, name_spans
from .hub import check_timeouts


def add_model_args(p: argparse.ArgumentParser, decoding: bool = True) -> None:
    """Options shared by every subcommand that loads a target + drafter pair.

    ``decoding`` False: for a command that picks the decoding itself (bench), whose
    --draft-mode, --no-draft, --compile, --max-context and --prefill-chunk are parsed (for
    it to refuse them with a message) but left out of its --help."""

    def shown(text: str) -> str:
        return text if decoding else argparse.SUPPRESS

    p.add_argument("--target", type=path_arg, help="target checkpoint dir or HF id (ORG/NAME[@REVISION]), downloaded unless cached (default: the shipped default target)")
    p.add_argument("--draft", type=path_arg, help="DFlash drafter checkpoint dir or HF id (ORG/NAME[@REVISION]), downloaded unless cached (default: the shipped drafter, "
                                  "which goes with the shipped target only)")
    p.add_argument("--dtype", default="auto", help="auto (default: bfloat16 on CUDA, float32 on CPU), float32 (fp32) or bfloat16 (bf16); "
                   "any case")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N; any case")
    p.add_argument("--block-size", type=int, default=None, help="tokens per draft block (default: the drafter's)")
    p.add_argument("--draft-mode", default="inject" if decoding else None, choices=["inject", "recompute"], help=shown("drafter context: persistent injected KV cache (default) or cache-less recompute"))
    p.add_argument("--no-draft", action="store_true", help=shown("target-only autoregressive decoding"))
    p.add_argument("--compile", action="store_true", help=shown("fixed-shape rounds compiled with torch.compile"))
    p.add_argument("--max-context", type=int, default=None, help=shown("longest prompt + generation in tokens (default: the target's limit)"))
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help=shown("prompt tokens per prefill forward (default 256; smaller bounds one forward's memory)"))
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch, at most the CPUs this process may use; wins over OMP_NUM_THREADS (default: torch's choice, OMP_NUM_THREADS where set)")
    p.add_argument("--mxfp4", default="auto", choices=["auto", "dequantize", "packed"],
                   help="MXFP4 / FP4 expert weights (gpt-oss, DeepSeek-V4-Flash): dequantize when loading, keep packed (a quarter of the "
                        "memory, slower), or auto (default: dequantize if that fits in 90%% of free memory)")
    p.add_argument("--fp8", default="auto", choices=["auto", "dequantize", "packed"],
                   help="weights of a fine-grained FP8 checkpoint (e.g. Qwen3-8B-FP8): dequantize when loading, keep "
                        "them as stored (about half of bfloat16's memory, slower), or auto (default: dequantize if "
                        "that fits in 90%% of free memory)")
    p.add_argument("--int-weights", default="auto", choices=["auto", "dequantize", "packed"],
                   help="packed integer weights of a compressed-tensors W4A16 / W8A16 checkpoint: dequantize when "
                        "loading, keep them packed (about a quarter / half of bfloat16's memory, slower), or auto "
                        "(default: dequantize if that fits in 90%% of free memory)")
    p.add_argument("--nvfp4", default="auto", choices=["auto", "dequantize", "packed"],
                   help="NVFP4 weights of a compressed-tensors nvfp4-pack-quantized or ModelOpt NVFP4 checkpoint: "
                        "dequantize when loading, keep them packed (about 0.28 of bfloat16's memory, slower, the same "
                        "logits), or auto (default: dequantize if that fits in 90%% of free memory)")


def check_stdout() -> None:
    """Refuse to start where stdout is closed (``>&-``): the output would be lost.

    Raises:
        OutputError: stdout is closed.
    """
    if sys.stdout is None:
        raise OutputError("stdout is closed: nowhere to write the output")


def write_stdout(text: str) -> None:
    """Write ``text`` to stdout and flush it.

    Raises:
        BrokenPipeError: the reader went away (as before: the command ends quietly).
        OutputError: any other error writing it (e.g. ``No space left on device``).
    """
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise stdout_error(exc) from None


def stdout_error(exc: OSError) -> OutputError:
    """The error of a write to stdout that failed with ``exc`` (not a broken pipe): one line,
    ``cannot write the output to stdout: <reason>``."""
    return OutputError(f"cannot write the output to stdout: {exc.strerror or exc}")


@contextmanager
def stdout_kept_going():
    """For a command whose product is files, stdout carrying only a report of them (bench):
    :func:`check_stdout`, then, inside the block, ``sys.stdout`` is a :class:`_Diagnostics`,
    whose writes that fail (a reader that went away, a full disk) are dropped, and the command
    goes on writing its files. Yields it: its ``error`` is the first such failure (None: none).
    Raise :func:`raise_stdout_error` once the files are written.

    Raises:
        OutputError: stdout is closed (before the block runs).
    """
    check_stdout()
    stream = _Diagnostics(sys.stdout)
    sys.stdout = stream
    try:
        yield stream
    finally:
        if sys.stdout is stream:
            sys.stdout = stream._stream


def raise_stdout_error(stream: "_Diagnostics") -> None:
    """Raise what the failure of :func:`stdout_kept_going`'s ``stream`` means, as a write of
    :func:`write_stdout`'s would have: nothing where none failed.

    Raises:
        BrokenPipeError: the reader went away (the command ends quietly, status 0).
        OutputError: any other failure (e.g. ``No space left on device``: one line, status 1).
    """
    if isinstance(stream.error, BrokenPipeError):
        raise stream.error
    if stream.error is not None:
        raise stdout_error(stream.error)


def _lexists(path: Path) -> bool:
    """Whether ``path`` is there (a dangling link too); True where that cannot be told."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def missing_dirs(path: Path) -> list[Path]:
    """The directories ``path.mkdir(parents=True)`` would make: ``path`` and its ancestors
    that do not exist yet, as the real paths the OS makes them at (a ``..`` in ``path``
    makes the directory before it too, and one after a link to a directory goes up from
    where the link leads), deepest first. A command that fails removes those it made
    (bench, train)."""
    missing = set()
    while not _lexists(path) and path != path.parent:
        missing.add(Path(os.path.realpath(path)))
        path = path.parent
    return sorted((p for p in missing if not _lexists(p)), key=lambda p: len(p.parts), reverse=True)


def path_arg(text: str) -> str:
    """argparse type of a flag that names a file or directory (or a Hugging Face id): the
    text as given, whatever its bytes (a path need not be UTF-8; the value of every other
    flag must be: see :class:`_Parser`), a leading ``~`` expanded as a shell expands it
    where it can (``--out=~/x`` and a quoted ``'~/x'`` reach us unexpanded)."""
    return os.path.expanduser(text)


def text_or_file(text: str) -> str:
    """argparse type of a flag that takes its text or ``@FILE`` (``--json-schema``,
    ``--grammar``): as given; an ``@FILE``'s path need not be UTF-8 (the file's text must be,
    :func:`structured_output` reads it so), its leading ``~`` expanded as :func:`path_arg`
    expands a path's (a shell leaves ``@~/x`` as it is)."""
    return "@" + path_arg(text[1:]) if text.startswith("@") else text


def argv_text(text: str, what: str) -> str:
    """``text`` from the command line checked to be UTF-8 text (Python reads a byte of argv
    that is not as a lone surrogate, which no tokenizer, regex or grammar takes).

    Raises:
        DFlashError: ``{what} is not UTF-8 text (byte 0x.. at offset N)`` (:func:`utf8_text`).
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        data = os.fsencode(text)  # (argv's bytes)
    except UnicodeEncodeError:  # (a surrogate no byte gives: main() called from Python)
        data = text.encode("utf-8", "surrogatepass")
    return utf8_text(data, what)


def int_or_auto(text: str) -> int | str:
    """argparse type of ``--draft-max-batch-size``: ``auto`` or an integer (its range is
    checked with the other options)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {text!r}") from None


def _json_object(text: str, what: str) -> dict:
    """``text`` parsed as a JSON object, else an argparse error saying it must be ``what``; one
    that gives a key twice (in any of its objects) is refused too: which value is meant?"""
    def unique(pairs: list[tuple[str, object]]) -> dict:
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise argparse.ArgumentTypeError(f"gives the key {key!r} twice (which value is meant?)")
            seen.add(key)
        return dict(pairs)

    try:
        value = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be {what} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def json_object(text: str) -> dict:
    """argparse type of ``--chat-template-kwargs``: a JSON object."""
    return _json_object(text, "a JSON object, e.g. '{\"enable_thinking\": false}'")


def logit_bias_json(text: str) -> dict[str, object]:
    """argparse type of ``--logit-bias``: a JSON object of token ids (decimal strings) to numbers,
    its keys as given: :func:`load_engine` checks it as
    :class:`~dflash_torch.sampling.SamplingParams` does (:func:`~dflash_torch.sampling.check_logit_bias`:
    the values' range, one token given twice, ``"1"`` and ``"01"``)."""
    value = _json_object(text, "a JSON object of token ids to biases, e.g. '{\"0\": -100}'")
    bad = next((k for k in value if not (k.isascii() and k.isdigit())), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"keys must be token ids (decimal integers >= 0), got {bad!r}")
    return value


def add_chat_template_kwargs_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help=f"extra chat template variables {what}, a JSON object, e.g. '{{\"enable_thinking\": false}}' "
                        "(Qwen3's non-thinking mode, which the published Qwen3 DFlash drafters were trained on) or "
                        "'{\"reasoning_effort\": \"low\"}' (gpt-oss)")


def add_sampling_args(p: argparse.ArgumentParser, max_new_help: str = "default 256", recommended: bool = False) -> None:
    """The sampling flags. ``recommended``: the command takes --max-new-tokens, --temperature,
    --top-k, --top-p, --min-p and --repetition-penalty from the target's generation_config.json
    where they are not given (chat), and their help says so."""

    def default(value: str, key: str) -> str:
        return f"default: the target's generation_config.json's {key}, else {value}" if recommended else f"default {value}"

    p.add_argument("--max-new-tokens", type=int, default=None, help=f"maximum generated tokens ({max_new_help})")
    p.add_argument("--temperature", type=float, default=None if recommended else 0.0,
                   help=f"0 = greedy ({default('0', 'temperature')})")
    p.add_argument("--top-k", type=int, default=None if recommended else 0,
                   help=f"keep the k most likely tokens (0 or -1 = off; {default('0', 'top_k')})")
    p.add_argument("--top-p", type=float, default=None if recommended else 1.0,
                   help=f"1 = off ({default('1', 'top_p')})")
    p.add_argument("--min-p", type=float, default=None if recommended else 0.0,
                   help=f"in [0, 1]: drop tokens less likely than min-p times the most likely one ({default('0', 'min_p')}; 0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler (with --temperature > 0): the same seed and options give the same output "
                   "(default: none, a new sample each run)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2], subtracted from the logit of every token generated so far (default 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2], times each token's count so far, subtracted from its logit (default 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None if recommended else 1.0,
                   help="> 0, divides positive / multiplies negative logits of prompt and generated tokens "
                        f"({default('1', 'repetition_penalty')}; 1 = off)")
    p.add_argument("--logit-bias", type=logit_bias_json, default=None, metavar="JSON",
                   help="token id -> bias in [-100, 100] added to its logit, a JSON object, e.g. '{\"0\": -100}' "
                        "(-100 bans the token, 100 forces it)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="generate at least this many tokens before EOS, a stop token or a stop string can end "
                        "the output (default 0)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable), taken as written: no escapes are read, so '\\n' is a backslash and "
                        "an n; in bash, --stop $'\\n' passes a newline")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")


# the sampling flags whose values a target's generation_config.json may recommend, and their values where
# a command takes neither a flag nor the file (greedy decoding; chat adds max_new_tokens)
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_config_values(values: dict) -> str:
    """generation_config.json's ``values`` (a dict of field -> value) as a note on stderr names
    them: ``"temperature 0.7, top_k 20"`` (chat's note of the values it takes, generate's of
    those it leaves)."""
    return ", ".join(f"{k} {v}" for k, v in values.items())


def unused_generation_config_note(recommended: dict, given: dict) -> str | None:
    """``generate``'s note of the values the target's generation_config.json recommends
    (``recommended``: ``engine.generation_defaults``) that it leaves unused (it takes sampling
    values from its flags only): each one whose flag is not among ``given`` (flag dest ->
    value, the sampling flags given), that differs from greedy decoding's (:data:`GREEDY`) and
    that would change this decode (``top_k``, ``top_p`` and ``min_p`` only where it would
    sample: at the given ``--temperature``, else the file's), with the flags that would use
    them; None where none is left so."""
    unused = {k: v for k, v in recommended.items() if k in GREEDY and k not in given and v != GREEDY[k]}
    temperature = given.get("temperature", unused.get("temperature", 0.0))
    if not temperature:  # (greedy either way: the truncations change nothing)
        unused = {k: v for k, v in unused.items() if k not in ("top_k", "top_p", "min_p")}
    if not unused:
        return None
    decoding = f"sampling at temperature {given['temperature']}" if given.get("temperature") else "greedy decoding"
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in unused.items())
    return (f"note: {decoding}; the target's generation_config.json values ({generation_config_values(unused)}) are "
            f"not used (generate takes sampling values from its flags only): pass {flags} to use them")


# structured-output flags of ``generate``: flag -> StructuredOutput field
STRUCTURED_FLAGS = {"--json-schema": "json", "--json-object": "json_object", "--regex": "regex", "--choice": "choice",
                    "--grammar": "grammar"}


def add_structured_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-schema", type=text_or_file, default=None, metavar="SCHEMA",
                   help="constrain the output to JSON valid under this JSON schema (its JSON text, or @FILE)")
    p.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    p.add_argument("--regex", default=None, metavar="R", help="constrain the output to match this regular expression")
    p.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="constrain the output to one of these strings (repeatable)")
    p.add_argument("--grammar", type=text_or_file, default=None, metavar="G",
                   help="constrain the output to this llguidance Lark grammar (its text, or @FILE), e.g. "
                        "'start: \"yes\" | \"no\"'")


def _text_or_file(value: str, flag: str) -> str:
    """``value``, or the UTF-8 text of the file ``@PATH`` names."""
    if not value.startswith("@"):
        return value
    try:
        with open(value[1:], "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise DFlashError(f"{flag}: cannot read {value[1:]!r}: {exc.strerror}") from None
    return utf8_text(data, f"{flag} {value}")


def structured_output(args: argparse.Namespace) -> dict | None:
    """The ``structured_output`` of ``generate``'s flags (None for none); an error about it
    then names the flag given (``args.option_flags``).

    Raises:
        DFlashError: more than one of the flags, a file that cannot be read, a schema that is not JSON.
    """
    given = [flag for flag, dest in STRUCTURED_FLAGS.items()
             if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if len(given) > 1:
        raise DFlashError(f"give at most one of {', '.join(STRUCTURED_FLAGS)}; got {' and '.join(given)}")
    if not given:
        return None
    flag = given[0]
    value = getattr(args, flag[2:].replace("-", "_"))
    if flag == "--json-schema":
        text = _text_or_file(value, flag)
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise DFlashError(f"--json-schema must be a JSON schema (JSON text or @FILE): {exc}") from None
    elif flag == "--grammar":
        value = _text_or_file(value, flag)
    args.option_flags = {**args.option_flags, "structured_output": flag}
    return {STRUCTURED_FLAGS[flag]: value}


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (when given) to the engine's compute thread; without it, torch
    takes ``OMP_NUM_THREADS``, which a line on stderr warns of where it is more than the CPUs
    this process may use (:func:`omp_threads_warning`)."""
    from . import compute

    if args.threads is not None:
        compute.set_num_threads(args.threads, name="--threads")
    elif (warning := omp_threads_warning()) is not None:
        print(warning, file=sys.stderr, flush=True)


def omp_threads_warning() -> str | None:
    """The warning that ``OMP_NUM_THREADS``, which torch takes for its thread count where
    ``--threads`` is not given, is more than the CPUs this process may use (its affinity,
    e.g. ``taskset``; ``--threads`` refuses such a count): its threads contend for them.
    None where it is not set, not a number, or not more."""
    from .options import usable_cpus

    value, cpus = os.environ.get("OMP_NUM_THREADS", "").strip(), usable_cpus()
    if not value.isdigit() or cpus is None or int(value) <= cpus:
        return None
    return (f"dflash-torch: WARNING: OMP_NUM_THREADS={value} is more than the CPUs this process may use ({cpus}): "
            f"torch's threads contend for them; give --threads {cpus} (it wins over OMP_NUM_THREADS) or a smaller "
            "OMP_NUM_THREADS")


def check_model_options(args: argparse.Namespace) -> None:
    """The model options of ``args`` that need no model: ``--no-draft`` with ``--draft``,
    ``--device`` (held as torch spells it: ``CPU`` -> ``cpu``), ``--dtype`` (on that device)
    and ``--threads`` (where the command takes it). :meth:`DFlashEngine.from_pretrained`
    checks them again; ``serve`` checks them here before it says it loads anything.

    Raises:
        DFlashError: ``--no-draft`` with ``--draft``.
        OptionError: an unsupported device, dtype or thread count (one line, naming the flag).
    """
    from .options import check_threads, resolve_device, resolve_dtype

    if args.no_draft and args.draft:
        raise DFlashError("--no-draft decodes with the target alone; drop --draft (or --no-draft)")
    device = resolve_device(args.device)
    args.device = str(device)  # (its name as torch spells it: CUDA:0 -> cuda:0)
    resolve_dtype(args.dtype, device=device)
    if getattr(args, "threads", None) is not None:
        check_threads(args.threads, "--threads")


def load_engine(args: argparse.Namespace):
    """A :class:`DFlashEngine` from the model options of ``args``; ``--logit-bias`` (where the
    command takes it) is checked first, and held with int token ids.

    Raises:
        DFlashError: a model option's value, or ``--logit-bias``'s, before anything loads.
    """
    from .engine import DFlashEngine
    from .sampling import check_logit_bias

    check_model_options(args)
    if getattr(args, "logit_bias", None) is not None:  # (a token given twice: "1" and "01")
        args.logit_bias = check_logit_bias(args.logit_bias)
    set_threads(args)
    return DFlashEngine.from_pretrained(
        args.target, args.draft, dtype=args.dtype, device=args.device,
        block_size=args.block_size, draft_mode=args.draft_mode, no_draft=args.no_draft,
        compile=args.compile, max_context=args.max_context, mxfp4=args.mxfp4, fp8=args.fp8,
        int_weights=args.int_weights, nvfp4=args.nvfp4,
        **({"prefill_chunk": args.prefill_chunk} if args.prefill_chunk is not None else {}),
        **({"max_batch_size": args.max_batch_size} if hasattr(args, "max_batch_size") else {}),
        **({"reuse_prefix": not args.no_prefix_reuse} if hasattr(args, "no_prefix_reuse") else {}),
        **({"prefix_slots": args.prefix_slots} if hasattr(args, "prefix_slots") else {}),
        **({"shared_starts": args.shared_starts} if getattr(args, "shared_starts", None) is not None else {}),
        **({"draft_max_batch_size": args.draft_max_batch_size} if hasattr(args, "draft_max_batch_size") else {}),
    )


def _generate(args: argparse.Namespace) -> int:
    from . import compute

    run = {"engine": None, "chunks": []}  # (what --json's object of a Ctrl-C holds: the engine, the chunks so far)
    with compute.this_thread():  # loading and decoding on this thread, interrupted by Ctrl-C as usual
        try:
            return _generate_here(args, run)
        except KeyboardInterrupt:  # (exit status 130, as the streamed text's; before the decode began: no text)
            if args.json:
                engine, got = run["engine"], run["chunks"]
                write_stdout(json.dumps(_json_result(engine, args, engine._result(got) if got else None)) + "\n")
            raise


def _generate_here(args: argparse.Namespace, run: dict) -> int:
    from .options import n_tokens

    check_stdout()
    if args.prompt is not None and args.prompt_text is not None:
        raise DFlashError("give the prompt either as an argument or with --prompt, not both")
    prompt = args.prompt if args.prompt is not None else args.prompt_text
    if args.prompt == "-":  # (stdin, as Unix tools read "-"; --prompt - is the text "-")
        prompt = None
    if prompt is None:
        if sys.stdin is None or (sys.stdin.isatty() and args.prompt != "-"):  # ("-" reads a terminal to Ctrl-D, as cat -)
            raise DFlashError("no prompt: pass --prompt TEXT, a positional prompt, or pipe it on stdin"
                              + "; to type it at the terminal: generate - (ended by Ctrl-D)" * (sys.stdin is not None))
    if args.chat_template_kwargs is not None and not args.chat:
        raise DFlashError("--chat-template-kwargs apply to chat prompts only: add --chat")
    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise DFlashError(f"{flag} needs --json (the log-probabilities are printed in its JSON object)")
    structured = structured_output(args)
    given = [k for k in GREEDY if getattr(args, k) is not None]  # (sampling flags given: not in the note)
    for k, v in GREEDY.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    engine = run["engine"] = load_engine(args)
    if prompt is None:  # (read once the engine is loaded: how much of stdin can fit its context is known then)
        prompt = _stdin_prompt(engine, args.chat)
    try:
        recommended = engine.generation_defaults
    except DFlashError:  # (a file refused: generate reads no sampling value from it)
        recommended = {}
    note = unused_generation_config_note(recommended, {k: getattr(args, k) for k in given})
    if note is not None:  # (stderr: --json's object on stdout stays whole)
        print(note, file=sys.stderr, flush=True)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, seed=args.seed, presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                  logit_bias=args.logit_bias, min_tokens=args.min_tokens, stop=args.stop, ignore_eos=args.ignore_eos, chat=args.chat, logprobs=args.logprobs,
                  prompt_logprobs=args.prompt_logprobs, chat_template_kwargs=args.chat_template_kwargs,
                  structured_output=structured)
    if args.json:  # (a Ctrl-C prints the object of the chunks so far: see _generate)
        out = engine.generate(prompt, on_chunk=run["chunks"].append, **kwargs)
        write_stdout(json.dumps(_json_result(engine, args, out)) + "\n")
        warn_compile_losses(args)
        return 0
    stats, finish = None, None
    if hasattr(sys.stdout, "reconfigure"):  # (a character stdout cannot encode: replaced, not a traceback)
        sys.stdout.reconfigure(errors="replace")
    # (stdout holds the generated text as it is, `generate ... > file`, a pipe; on a terminal a line break follows it,
    # so that the shell's prompt starts a line of its own)
    end = "\n" if _isatty(sys.stdout) else ""
    streamed = 0
    try:
        for chunk in engine.stream(prompt, **kwargs):
            write_stdout(chunk.text)
            stats, finish, streamed = chunk.stats, chunk.finish_reason, streamed + len(chunk.token_ids)
    except KeyboardInterrupt:  # (the text so far, as chat's interrupted reply: exit status 130)
        write_stdout(end)
        print(f"[{n_tokens(streamed)}, finish=interrupted]", file=sys.stderr)
        raise
    write_stdout(end)
    # the first token comes from the prefill: with one token there was no decoding round
    decode = (f"mean tau {stats.mean_acceptance_length:.2f}, decode {stats.decode_tokens_per_second:.1f} tok/s, "
              if stats.acceptance_lengths else "no decoding round, ")
    print(
        f"[{n_tokens(stats.generated_tokens)}, finish={finish}, {decode}prefill {stats.prefill_time * 1000:.0f} ms"
        f"{' (times include the one-off compilation)' if args.compile else ''}]",
        file=sys.stderr,
    )
    warn_compile_losses(args)
    return 0


def _json_result(engine, args: argparse.Namespace, out) -> dict:
    """``generate --json``'s object of ``out``, the
    :class:`~dflash_torch.engine.GenerationResult` of its run: ``text``, ``token_ids``,
    ``finish_reason``, ``stats`` (:meth:`~dflash_torch.engine.GenerationStats.to_dict`, and
    ``times_include_compilation``: ``--compile``'s one run includes building the graphs),
    ``logprobs`` and ``prompt_logprobs`` (:func:`logprobs_json`; null where not asked for).
    A run a Ctrl-C (SIGINT) stopped: ``out`` holds the chunks it got (None: none), its
    ``finish_reason`` is ``"interrupted"`` and its ``stats`` only ``generated_tokens``, as the
    streamed text's stats line says only the count then (``[N tokens, finish=interrupted]``:
    the measurements come with a run's last chunk)."""
    if out is None or out.finish_reason is None:  # (interrupted)
        stats = {"generated_tokens": 0 if out is None else len(out.token_ids)}
        finish = "interrupted"
    else:
        stats = {**out.stats.to_dict(), "times_include_compilation": bool(args.compile)}
        finish = out.finish_reason
    prompt_logprobs = None
    if out is not None and out.prompt_logprobs is not None:  # (the first prompt token has none: null)
        first, rest = out.prompt_logprobs[0], out.prompt_logprobs[1:]
        prompt_logprobs = [None if first is None else logprobs_json(engine, [first])[0]] + logprobs_json(engine, rest)
    return {"text": "" if out is None else out.text, "token_ids": [] if out is None else out.token_ids,
            "finish_reason": finish, "stats": stats,
            "logprobs": [] if out is None and args.logprobs is not None else logprobs_json(engine, out and out.logprobs),
            "prompt_logprobs": prompt_logprobs}


def _isatty(stream) -> bool:
    """Whether ``stream`` (stdout, stderr) is a terminal (False where it has none, or is closed)."""
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError, AttributeError):
        return False


def _stdin_prompt(engine, chat: bool) -> str:
    """``generate``'s prompt read from stdin (bytes, as UTF-8: the locale's error handler may be
    strict), no further than a prompt that could fit ``engine``'s context can reach
    (:func:`read_stdin`: an endless or huge stdin, ``yes |``, costs no more memory than that);
    ``chat``: a message, whose final line break (``\n`` or ``\r\n``, which echo or an editor
    adds) is not part of it, as a ``chat`` line's is not.

    Raises:
        ContextLengthError: stdin holds more than ``engine.max_prompt_chars`` characters
            (:func:`too_long_error`).
        DFlashError: its bytes are not UTF-8 (:func:`read_stdin`).
    """
    text, whole = read_stdin(engine.max_prompt_chars + 2 * chat, "the prompt on stdin")
    if not whole:
        raise too_long_error(engine, "the prompt on stdin")
    return text.removesuffix("\n").removesuffix("\r") if chat else text


def too_long_error(engine, what: str) -> ContextLengthError:
    """The refusal of ``what``, a text read no further than ``engine.max_prompt_chars``
    characters, past which it went on: a :class:`~dflash_torch.errors.ContextLengthError` in
    the words of the engine's own refusal of a prompt too long for its context (``... has more
    than N characters: more than the context of C tokens can hold (at most N characters with
    this tokenizer)``)."""
    return ContextLengthError(f"{what} has more than {engine.max_prompt_chars} characters: more than the context of "
                              f"{engine.max_context} tokens can hold (at most {engine.max_prompt_chars} characters "
                              "with this tokenizer)")


def read_stdin(limit: int, what: str) -> tuple[str, bool]:
    """Stdin's text to its end, reading no more of it than ``limit`` characters need (at most
    4 bytes each, and one character more: an endless stdin is read so far, not until memory
    runs out) -> ``(text, whole)``: ``whole`` False where stdin holds more than ``limit``
    characters (``text`` then holds the first ``limit``; the rest is left unread). Read as
    bytes from ``sys.stdin.buffer`` where it has one, and decoded as UTF-8.

    Raises:
        DFlashError: ``{what} is not UTF-8 text (byte 0x.. at offset N)`` (N: bytes from the
            start of stdin), as :func:`utf8_text` says it, for the bytes read.
    """
    import codecs
    import io

    stdin = getattr(sys.stdin, "buffer", None)
    if stdin is None:  # (a text stream: characters)
        text = sys.stdin.read(limit + 1)
        return text[:limit], len(text) <= limit
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts, chars, fed = [], 0, 0
    while chars <= limit:
        asked = limit + 1 - chars  # (a byte is at most one character: never past limit + 1)
        data = stdin.read(asked)
        # (a buffered stream's short read is its end: a terminal's Ctrl-D ends one read, not the next)
        end = not data or (len(data) < asked and isinstance(stdin, io.BufferedIOBase))
        pending = len(decoder.getstate()[0])  # (the bytes of a character cut short, which this read goes on)
        try:
            text = decoder.decode(data, final=end)
        except UnicodeDecodeError as exc:  # (offsets in pending + data)
            at = fed - pending + exc.start
            raise DFlashError(f"{what} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {at})") from None
        fed += len(data)
        parts.append(text)
        chars += len(text)
        if end:
            break
    text = "".join(parts)
    return text[:limit], len(text) <= limit


def logprobs_json(engine, logprobs) -> list[dict] | None:
    """``--json``'s ``logprobs``: one object per generated token (``logprobs``, the
    :class:`~dflash_torch.sampling.TokenLogprob` s of a result; None without ``--logprobs``):
    ``token_id``, ``token`` (:meth:`DFlashEngine.token_text`), ``bytes`` (its bytes as
    integers), ``logprob`` (natural log) and ``top_logprobs``, the K most likely tokens
    there, most likely first, each with the same four keys but ``top_logprobs``."""
    if logprobs is None:
        return None

    def item(token_id: int, logprob: float) -> dict:
        return {"token_id": token_id, "token": engine.token_text(token_id),
                "bytes": list(engine.token_bytes(token_id)), "logprob": logprob}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in logprobs]


def utf8_text(data: bytes, what: str) -> str:
    """``data`` decoded as UTF-8.

    Raises:
        DFlashError: ``{what} is not UTF-8 text (byte 0x.. at offset N)``.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DFlashError(f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def add_warmup_arg(p: argparse.ArgumentParser, past: str) -> None:
    """``--warmup-context`` (serve, chat): how far :func:`warm_up` builds the graphs;
    ``past``: what happens to a sequence that goes past it."""
    p.add_argument("--warmup-context", type=int, default=None,
                   help="with --compile: build at start-up the graphs of every length bucket that sequences "
                        f"of up to this many tokens reach (default 256); {past}")


def check_warmup_context(args: argparse.Namespace) -> None:
    """Refuse a ``--warmup-context`` that is not a count, or that is given without ``--compile``.

    Raises:
        DFlashError: naming ``--warmup-context``.
    """
    from .options import check_count

    if args.warmup_context is not None:
        check_count(args.warmup_context, "--warmup-context")
        if not args.compile:
            raise DFlashError("--warmup-context has no effect without --compile (nothing is compiled); drop it")


def warm_up(engine, args: argparse.Namespace, batch: bool = False, file=None) -> None:
    """With ``--compile``: build the decoding graphs now (:meth:`DFlashEngine.warmup`, up to
    ``--warmup-context`` tokens, default 256, capped at the context with a note on stderr;
    ``batch``: the batch decoder's too), saying so and how long it took on ``file`` (default
    stdout), then :func:`warn_compile_losses`."""
    if not args.compile:
        return
    file = sys.stdout if file is None else file
    context = args.warmup_context or 256
    if args.warmup_context is not None and context > engine.max_context:  # (engine.warmup caps it)
        print(f"note: --warmup-context {context} is more than the context of {engine.max_context} tokens: the graphs "
              f"are built up to {engine.max_context}", file=sys.stderr, flush=True)
    print("dflash-torch: compiling the decoding graphs (one-off) ...", file=file, flush=True)
    took = engine.warmup(batch=batch, context=context)
    print(f"dflash-torch: compiled in {took:.1f} s", file=file, flush=True)
    warn_compile_losses(args)


def warn_compile_losses(args: argparse.Namespace) -> None:
    """With ``--compile``: :func:`warn_compile` for the compiled steps of this process
    that ran eager and (on CUDA) the graphs that ran without CUDA graphs."""
    from .decoding import compile_counts, eager_fallbacks

    if args.compile:
        warn_compile("--compile", skipped=compile_counts()[1] if args.device.startswith("cuda") else None,
                     fallbacks=eager_fallbacks())


def warn_compile(name: str, recompiles: int | None = None, skipped: int | None = None,
                 fallbacks: int | None = None) -> None:
    """A loud line on stderr when compiled decoding recompiled after its warm-up, ran
    graphs without CUDA graphs (inductor skipped them) or ran compiled steps eager
    (they reached torch's recompile limit): each costs most of the speed that compiling
    is for, and figures measured so are not what they claim."""
    if fallbacks:
        print(f"WARNING: {name}: {fallbacks} compiled step(s) reached torch's recompile limit and run EAGER from "
              "then on (run with TORCH_LOGS=recompiles to see why)", file=sys.stderr, flush=True)
    if skipped:
        print(f"WARNING: {name}: {skipped} compiled graph(s) ran WITHOUT CUDA graphs (skipped by inductor; "
              "run with TORCH_LOGS=perf_hints to see why)", file=sys.stderr, flush=True)
    if recompiles:
        print(f"WARNING: {name}: {recompiles} recompile(s) after warm-up (run with TORCH_LOGS=recompiles to see why)",
              file=sys.stderr, flush=True)


def close_flags(unknown: str, flags) -> list[str]:
    """The long ``flags`` an ``unknown`` one (``--name`` or ``--name=value``) may have meant, at
    most 3: those it begins (an abbreviation, not taken as one: see :class:`_Parser`), else those
    whose names difflib's ``get_close_matches`` finds close to its name (a typo); ``[]``: none."""
    name = unknown.split("=", 1)[0].removeprefix("--").lower()  # (--TEMPERATURE: --temperature)
    names = sorted({f.removeprefix("--") for f in flags if f.startswith("--")})
    found = [n for n in names if n.startswith(name)] if name else []
    return ["--" + n for n in (found[:3] if found else difflib.get_close_matches(name, names, n=3))]


# a number as float() takes it: a negative one is a value, not a flag (argparse's own rule missed an exponent and
# inf: `--lr -1e-3` was "expected one argument", not --lr's range check; trial-293 f)
# (the hint of words that follow generate's prompt after --: argparse takes one argument for it)
_PROMPT_WORDS = ": the prompt is one argument, quote it (dflash-torch generate [OPTIONS] -- 'PROMPT WORDS')"
_NUMBER = re.compile(r"-?(?:(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf(?:inity)?|nan)", re.IGNORECASE)
_NEGATIVE_NUMBER = re.compile(rf"(?=-)(?:{_NUMBER.pattern})\Z", re.IGNORECASE)  # (argparse's matcher: .match)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line too (no usage dump), exit status 2, and
    that knows each of its options' flag: ``flags`` maps an option's ``dest`` to its first
    long flag (``max_new_tokens`` -> ``--max-new-tokens``); the parsed arguments carry the
    subcommand's map as ``option_flags``. Long flags are not taken abbreviated: a prefix of
    one was read as it (``--temp``), and a flag of another command as the one it begins
    (``serve --chat`` as --chat-template-kwargs, "expected one argument"); a flag added later
    would make a working abbreviation ambiguous. The value of every option and positional
    argument must be UTF-8 text (:func:`argv_text`: one line naming the flag, exit status 2),
    but for a path (``type=path_arg``, the path of ``type=text_or_file``'s ``@FILE``) and a
    default (``$DFLASH_API_KEY``: checked as the option's value). An argument that is a
    negative number as ``float()`` reads it (``-1e-3``, ``-inf``; argparse's own rule took
    these for flags) is a value, which the option's own checks then judge. (Subcommand
    parsers are made of this class too.)"""

    def __init__(self, *args, **kwargs):
        self.flags: dict[str, str] = {}  # (before __init__, which adds --help)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER
        self.set_defaults(option_flags=self.flags)

    @property
    def name(self) -> str:
        """The program its errors name: ``dflash-torch`` (a command's parser too, whose ``prog``
        is ``dflash-torch generate``), or a script's (:func:`script_parser`)."""
        return self.prog.split()[0]

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        long = [s for s in action.option_strings if s.startswith("--")]
        if long:
            self.flags.setdefault(action.dest, long[0])
        if action.nargs != 0 and action.type is not path_arg:  # (not a flag without a value, nor a path)
            action.type = self._text(action, long[0] if long else f"the {action.dest} argument")
        return action

    def _text(self, action: argparse.Action, what: str):
        """``action``'s type, that first refuses a value that is not UTF-8 text (:func:`argv_text`)."""
        convert = action.type

        def text(value: str):
            if value is not action.default and not (convert is text_or_file and value.startswith("@")):
                try:
                    value = argv_text(value, what)
                except DFlashError as exc:
                    self.exit(2, f"{self.name}: error: {exc}\n")
            return value if convert is None else convert(value)

        text.__name__ = getattr(convert, "__name__", "str")  # (argparse's "invalid int value: ...")
        return text

    def parse_args(self, args=None, namespace=None):
        """argparse's, but arguments no option takes are refused with a hint where the first
        unknown flag is close to flags of the command (:func:`close_flags`: ``--temp``, did you
        mean --temperature?)."""
        self._argv = list(sys.argv[1:] if args is None else args)  # (error's hint where no command is given)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command, flags = getattr(parsed, "command", None), getattr(parsed, "option_flags", self.flags)
            # (words after `--` are arguments, not options: `generate -- PROMPT --max-new-tokens 3`; where they are
            # all the unknown ones, only they are named, not a flag of the same name given before `--`)
            tail = self._argv[self._argv.index("--"):] if "--" in self._argv else []  # (from `--` on)
            after = len(tail) > 1 and not Counter(extras) - Counter(tail)
            hints = [self._hint(e, command, flags, after_dashes=after) for e in extras if e.startswith("--")]
            if after:  # (a spelling's hint: its flag too goes before --; trial-316 c)
                hints = [h + " (before --: the words after it are arguments)" if h.startswith("; did you mean") else h
                         for h in hints]
            first = tail[1].split("=", 1)[0] if after else ""  # (a flag of the command taken for the prompt)
            if after and not any(hints) and first in flags.values():
                hints.append(f"; the words after -- are arguments, not options: {first} was taken for the prompt; "
                             f"give it before -- (dflash-torch {command} {first} ... -- PROMPT)")
            if after and not any(hints):  # (`generate -- two words`: the prompt after -- is one argument)
                hints.append(f"; the words after -- are arguments, not options{_PROMPT_WORDS * (command == 'generate')}")
            self.error(f"unrecognized arguments: {self._shown(extras, tail if after else self._argv)}"
                       + next((h for h in hints if h), ""))
        return parsed

    def _shown(self, unknown: list[str], argv: list[str]) -> str:
        """The ``unknown`` arguments as :meth:`error` names them: where flags are among them,
        each unknown flag with the argument after it in the command line ``argv`` (its value as
        the user meant it; argparse took ``generate --temp 0.5 x``'s 0.5 for the prompt and
        named x)."""
        flags = {a for a in unknown if a.startswith("--")}
        if not flags:
            return " ".join(unknown)
        commands = self._commands()
        actions = [self._option_string_actions, *(p._option_string_actions for p in commands.values())]
        shown = []
        for i, arg in enumerate(argv):
            if arg in flags:
                takes = all(a[arg].nargs != 0 for a in actions if arg in a)  # (--no-draft takes none)
                value = argv[i + 1] if takes and i + 1 < len(argv) and "=" not in arg else None
                shown += [arg] + ([value] if value is not None and value not in commands
                                  and (not value.startswith("-") or _NUMBER.fullmatch(value)) else [])
        return " ".join(shown)

    def _print_message(self, message, file=None):
        """argparse's, but --help and --version text that stdout cannot take raise
        (:func:`write_stdout`: one line and status 1, not the text lost with status 0; argparse
        drops the error); with stdout closed (``>&-``; argparse writes them to stderr then, status
        0), :func:`check_stdout`'s one line, status 1, as generate's output."""
        if message and file is None and sys.stdout is None:  # (help or version meant for stdout: closed)
            check_stdout()
        if message and file is not None and file is sys.stdout:
            write_stdout(message)
        else:
            super()._print_message(message, file)

    def _commands(self) -> dict[str, "_Parser"]:
        """This parser's commands' parsers by name (``{}`` for a command's own parser)."""
        actions = self._subparsers._group_actions if self._subparsers is not None else ()
        return next((a.choices for a in actions if isinstance(a, argparse._SubParsersAction)), {})

    def _hint(self, unknown: str, command: str | None, flags: dict[str, str], after_dashes: bool = False) -> str:
        """:meth:`parse_args`'s hint for the flag ``unknown`` ("" for none): a flag of the
        ``command`` (``flags``: its map) given before the command's name, or one of this parser's
        given after it, or one of the command's given after ``--`` (``after_dashes``: the words
        after it are arguments, generate's prompt), says where it goes; else the command's and
        this parser's flags it may have meant (:func:`close_flags`)."""
        name = unknown.split("=", 1)[0]
        if after_dashes and command is not None and name in flags.values():
            if command == "generate":
                return (f"; the words after -- are the prompt, not options: give {name} before -- (dflash-torch "
                        f"generate {name} ... -- PROMPT)")
            return f"; the words after -- are not read as options: give {name} before -- (dflash-torch {command} {name} ...)"
        if command is not None and flags is not self.flags and name in flags.values():
            return f"; {name} is an option of {command}: give it after the command (dflash-torch {command} {name} ...)"
        if command is not None and name in self.flags.values():
            return f"; {name} is an option of dflash-torch itself: give it before the command (dflash-torch {name})"
        close = close_flags(unknown, [*flags.values(), *self.flags.values()])
        # (another tool's name for a flag, vLLM's --max-model-len: ours, before any spelling; --draft-model was
        # "--draft-mode?", --do-sample "--compile?")
        alias = flag_hint(unknown, [*flags.values(), *self.flags.values()])
        owners = [c for c, p in self._commands().items() if c != command and name in p.flags.values()]
        if owners:  # (another command's flag, serve's --port given to generate: whose it is, and the flags it
            where = ", ".join(owners[:-1]) + " and " * (len(owners) > 1) + owners[-1]  # begins, not typos' ones)
            close = [f for f in close if f.startswith(name.lower())]
            return (f"; {name} is an option of {where}, not of {command}" if command is not None else
                    f"; {name} is an option of {where}: give it after the command (dflash-torch {owners[0]} {name} "
                    "...)") + (f"; {alias}" if alias else "" if alias is not None
                              else f"; did you mean {' or '.join(close)}?" if close else "")
        if alias is not None:  # (another tool's name: ours, or none where this command has none; not a typo's)
            return f"; {alias}" if alias else ""
        return f"; did you mean {' or '.join(close)}?" if close else ""

    def error(self, message: str):
        if message.startswith("the following arguments are required: command"):  # (a flag it took for none: --verson)
            unknown = [a for a in getattr(self, "_argv", ()) if a.startswith("--") and a != "--"
                       and a.split("=", 1)[0] not in self._option_string_actions]
            if unknown:
                message += f"; unrecognized arguments: {' '.join(unknown)}" + self._hint(unknown[0], None, self.flags)
        elif message.startswith("argument command: invalid choice"):  # (a flag's value taken for the command:
            argv = getattr(self, "_argv", [])                         # --max-new-tokens 5 generate)
            unknown = [a for a in argv if a.startswith("--") and a.split("=", 1)[0] not in self._option_string_actions]
            if unknown and argv.index(unknown[0]) == 0:
                commands = self._commands()
                command = next((a for a in argv if a in commands), None)
                flags = commands[command].flags if command is not None else self.flags
                message = f"unrecognized arguments: {self._shown(unknown[:1], argv)}" + self._hint(unknown[0], command, flags)
        # (a value argparse quotes whole, e.g. "invalid int value: '999...'": its head and length)
        message = re.sub(r"'([^']{40})[^']{20,}'", lambda m: f"'{m.group(1)}...' ({len(m.group(0)) - 2} characters)",
                         message)
        self.exit(2, f"{self.name}: error: {message} (see --help)\n")


def script_parser(script: str, doc: str) -> _Parser:
    """The argument parser of a script of the repository's ``scripts/`` (``script``: its
    ``__file__``, ``doc``: its docstring, whose first paragraph is the description): the
    command line's (:class:`_Parser`: a usage error is one line ``NAME.py: error: ...``, exit
    status 2; long flags are not taken abbreviated), for :func:`script_errors`."""
    return _Parser(prog=Path(script).name, description=doc.split("\n\n")[0])


@contextmanager
def script_errors(parser: _Parser, args: argparse.Namespace):
    """Inside the block, a :class:`DFlashError` (an option value the package's checks refuse,
    :mod:`dflash_torch.options`; a file that cannot be read or written) ends a script as the
    ``dflash-torch`` command ends: one line ``NAME.py: error: MESSAGE`` on stderr
    (:func:`error_message`: an option's Python name as the script's flag) and exit status 2
    (``SystemExit(2)``). ``parser``: the script's :func:`script_parser`, ``args``: what it parsed."""
    try:
        yield
    except DFlashError as exc:
        parser.exit(2, f"{parser.name}: error: {error_message(exc, args.option_flags)}\n")


NEEDS_A_ROUND = "the first token comes from the prefill, so with fewer there is no decoding round to measure"
""":func:`check_counts`' ``why`` for a script's count of new tokens that it measures decoding rounds of."""


def check_counts(args: argparse.Namespace, *dests: str, minimum: int = 1, why: str | None = None) -> None:
    """Each option ``dests`` names (its ``dest`` in ``args``, parsed by a :class:`_Parser`) an
    integer >= ``minimum``, or None (not given) (:func:`~dflash_torch.options.check_count`);
    ``why``: what a smaller value would lack, said after the refusal.

    Raises:
        OptionError: naming the option's flag (``--reps must be an integer >= 1, got 0``;
            ``--new-tokens must be an integer >= 2, got 1: WHY``).
    """
    from .options import check_count

    for dest in dests:
        if getattr(args, dest) is None:
            continue
        flag = args.option_flags[dest]
        try:
            check_count(getattr(args, dest), flag, minimum)
        except OptionError as exc:
            if why is None:
                raise
            raise OptionError(f"{exc}: {why}", flag) from None


def check_out_file(path: str | None, flag: str) -> None:
    """Refuse, before a long run, a file to write its results to that cannot be written: a
    directory, one in a directory that does not exist, or one not writable (None: no file).

    Raises:
        DFlashError: naming ``flag`` and the path.
    """
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise DFlashError(f"{flag} {path} is a directory; give the path of a file to write")
    if not target.parent.is_dir():
        raise DFlashError(f"{flag} {path}: the directory {target.parent} does not exist")
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise DFlashError(f"{flag} {path}: permission denied")


def write_out_file(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to the results file ``path`` (:func:`check_out_file` checked it).

    Raises:
        DFlashError: an OS error (a full disk): ``cannot write PATH: REASON``.
    """
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise DFlashError(f"cannot write {path}: {exc.strerror or exc}") from None


@contextmanager
def deferred_interrupt():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until it ends, then raise
    ``KeyboardInterrupt`` (through the SIGINT handler there was: see :func:`entry`): for a
    block a Ctrl-C must not cut in two (the trainer's optimizer update, applied to every
    parameter or to none), or one that would swallow it (torch's import). A SIGTERM inside
    :func:`terminate_as_interrupt` is held so too. Only in the main thread (where Python
    delivers signals); elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = {signum: signal.signal(signum, lambda signum, frame: pending.append(signum))
                for signum in interrupt_signals()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(pending):  # (in the order they came; one ignored before the block stays so)
        handler = previous[signum]
        if handler is signal.SIG_IGN:
            continue
        if not callable(handler):
            raise KeyboardInterrupt
        handler(signum, None)


_terminations: list[int] | None = None  # the SIGTERMs _on_sigterm took (None: outside terminate_as_interrupt)


def _on_sigterm(signum, frame) -> None:
    """SIGTERM's handler inside :func:`terminate_as_interrupt`: the first raises
    ``KeyboardInterrupt``, as a Ctrl-C does; later ones are ignored (the clean-up of the first,
    e.g. train's checkpoint, goes on)."""
    if _terminations is None:
        return
    _terminations.append(signum)
    if len(_terminations) == 1:
        raise KeyboardInterrupt


def interrupt_signals() -> tuple[int, ...]:
    """The signals that interrupt the command as a Ctrl-C does: SIGINT, and SIGTERM inside
    :func:`terminate_as_interrupt` (a block that holds or ignores a Ctrl-C holds or ignores them all)."""
    return (signal.SIGINT, signal.SIGTERM) if signal.getsignal(signal.SIGTERM) is _on_sigterm else (signal.SIGINT,)


@contextmanager
def terminate_as_interrupt():
    """Inside the block, SIGTERM (what ``timeout``, ``docker stop``, systemd and Slurm send)
    raises ``KeyboardInterrupt`` as a Ctrl-C does, so that a command that keeps its work on
    Ctrl-C (train: its checkpoint) keeps it then too; the block then ends in
    ``SystemExit(143)`` (128 + SIGTERM) where it would end in ``KeyboardInterrupt`` or
    ``SystemExit(130)``. SIGTERM's handler before the block is restored after it. Only in the
    main thread, and where SIGTERM has its default action (one ignored or handled by the
    process that runs the command stays so); elsewhere the block runs as is."""
    global _terminations
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    _terminations = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        if _terminations and (isinstance(exc, KeyboardInterrupt) or exc.code == 130):
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        _terminations = None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-torch", description="DFlash speculative decoding with KV injection")
    with deferred_interrupt():  # (torch's import swallows a Ctrl-C inside its import of numpy: the command went on)
        import torch  # noqa: F401
    from . import __version__

    parser.add_argument("--version", action="version", version=f"dflash-torch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (or --prompt); -: read from stdin to its end (at a terminal: typed, ended by "
                        "Ctrl-D); left out: read from stdin where it is not a terminal (a pipe, a file)")
    g.add_argument("--prompt", dest="prompt_text", default=None, help="prompt text (taken as it is, - too)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    add_chat_template_kwargs_arg(g, "(with --chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text (stopped by "
                                                       "Ctrl-C: the object of what was generated so far, finish_reason "
                                                       "'interrupted', exit status 130)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each generated token's log-probability under the target and its K most likely "
                        "alternatives, 0 to 20 (the object's 'logprobs')")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="with --json: each prompt token's log-probability under the target (the first: null) and "
                        "its K most likely alternatives, 0 to 20 (the object's 'prompt_logprobs')")
    add_model_args(g)
    add_sampling_args(g, "default: the target's generation_config.json's max_new_tokens, else 256; cut to the "
                         "context the prompt leaves")
    add_structured_output_args(g)
    g.set_defaults(func=_generate, **dict.fromkeys(GREEDY))  # (None: not given; greedy, and a note where
    # the target's generation_config.json recommends other values: unused_generation_config_note)
    for module in ("chat", "serving.cli", "training.cli", "bench.cli"):  # (a missing dependency: main says which)
        __import__(f"dflash_torch.{module}", fromlist=["register"]).register(sub)
    return parser


def error_message(exc: DFlashError, flags: dict[str, str]) -> str:
    """The message of ``exc`` for the command line: an :class:`OptionError` about options
    this command has (each Python name in ``exc.names``, spaces read as underscores, is an
    option's dest in ``flags``) names the flags instead, at each name's first occurrence
    (``top_p must be ...`` -> ``--top-p must be ...``) as a word of its own, not inside a path
    or a longer name (``out /tmp/out`` -> ``--out /tmp/out``) nor in quoted text (``data 'my out'``),
    a bool field's ``name=True`` too (``pass overwrite=True`` -> ``pass --overwrite``:
    :func:`~dflash_torch.errors.name_spans`);
    a name given twice in ``exc.names`` replaces its first two occurrences, and so on
    (:func:`~dflash_torch.errors.named`)."""
    message = str(exc)
    if isinstance(exc, OptionError):
        for name in exc.names:
            flag = flags.get(name.replace(" ", "_"))
            if flag is not None:
                spans = name_spans(message, name)
                if spans:
                    message = message[:spans[0][0]] + flag + message[spans[0][1]:]
                # ("structured_output regex is invalid" for --regex, "... json schema ..." / "... json ..." for --json-schema)
                for word in (flag[2:], flag[2:].replace("-", " "), STRUCTURED_FLAGS.get(flag)):
                    if word and message.startswith(f"{flag} {word} "):
                        message = flag + message[len(flag) + 1 + len(word):]
                        break
    return message


# the packages whose import name is not their name on PyPI, among those dflash-torch's dependencies import
_PYPI_NAMES = {"yaml": "PyYAML", "PIL": "pillow", "dateutil": "python-dateutil"}


def import_error_message(exc: ImportError) -> str:
    """The error line for ``exc``, a package dflash-torch imports that is not installed (the
    module missing, found among the errors that led to it: transformers' lazy imports raise
    another one) or that cannot be imported (built for another numpy, ...), with what to install."""
    missing, seen = exc, 0
    while missing is not None and not (isinstance(missing, ModuleNotFoundError) and missing.name) and seen < 8:
        missing, seen = missing.__cause__ or missing.__context__, seen + 1
    if isinstance(missing, ModuleNotFoundError) and missing.name:
        module = missing.name.split(".")[0]
        package = _PYPI_NAMES.get(module, module)
        install = f"pip install {package}" + (" (a CPU-only machine: pip install torch --index-url "
                                               "https://download.pytorch.org/whl/cpu, not the CUDA build pip picks "
                                               "by default on Linux)" if package == "torch" else "")
        return f"the Python package {package!r} is not installed, and dflash-torch needs it: {install}"
    return f"a Python package dflash-torch needs cannot be imported ({first_line(exc)}); reinstall it"


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # (imports torch: a Ctrl-C while it loads is an interrupt like any other)
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:  # (an environment that lacks a dependency: not a traceback)
        print(f"dflash-torch: error: {import_error_message(exc)}", file=sys.stderr)
        return 1
    except (BrokenPipeError, OutputError) as exc:  # (--help or --version that stdout cannot take)
        return _output_failed(exc)
    try:
        check_timeouts()  # (before any import of huggingface_hub: its own check is a traceback)
        return args.func(args) or 0
    except ImportError as exc:
        print(f"dflash-torch: error: {import_error_message(exc)}", file=sys.stderr)
        return 1
    except CompileError as exc:  # (not the user's input: torch's compiler failed)
        print(f"dflash-torch: error: {exc}", file=sys.stderr)
        return 1
    except DFlashError as exc:
        print(f"dflash-torch: error: {error_message(exc, args.option_flags)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except (BrokenPipeError, OutputError) as exc:
        return _output_failed(exc)
    except Exception as exc:  # (the machine's memory ran out mid-run: one line, not torch's traceback)
        message = out_of_memory_message(exc, args.option_flags)
        if message is None:
            raise
        print(f"dflash-torch: error: {message}", file=sys.stderr)
        return 1


# options that ask for less memory where a command ran out of it, in the order a hint names them
_MEMORY_OPTIONS = ("prefill_chunk", "max_new_tokens", "max_context", "max_batch_size", "prefix_slots", "batch",
                   "seq_len", "self_distill_batch")


def out_of_memory(exc: BaseException) -> str | None:
    """The allocator's words where ``exc`` (or an error it was raised from, e.g. torch's
    compiler wrapping a ``MemoryError``) is the machine's memory running out: a
    ``MemoryError``, ``torch.OutOfMemoryError`` (a GPU's), or torch's CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory: ..."); None otherwise."""
    import torch

    seen = 0
    while exc is not None and seen < 16:
        text = str(exc).strip()
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
                isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)):
            text = text[text.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in text else text
            return (text.splitlines()[0] if text else type(exc).__name__)[:300]
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def out_of_memory_message(exc: BaseException, flags: dict[str, str]) -> str | None:
    """The command line's one line for ``exc`` where it is the memory running out
    (:func:`out_of_memory`; None otherwise): the allocator's words and the options of this
    command (``flags``: dest -> flag) that ask for less (:data:`_MEMORY_OPTIONS`). The load
    and start-up checks count the weights and caches; the activations of a forward pass (a
    long prefill chunk's attention, say) and torch's compiler are not counted."""
    reason = out_of_memory(exc)
    if reason is None:
        return None
    less = [flags[k] for k in _MEMORY_OPTIONS if k in flags]
    hint = f": free memory, or ask for less ({', '.join(less)})" if less else ": free memory"
    return f"out of memory while running ({reason}){hint}"


def _output_failed(exc: BrokenPipeError | OutputError) -> int:
    """The command's status where stdout failed with ``exc``: 0 for a reader that went away (a
    broken pipe: the reader's choice), else 1 after one line on stderr."""
    _drop_stdout()
    if isinstance(exc, BrokenPipeError):
        return 0
    print(f"dflash-torch: error: {exc}", file=sys.stderr)
    return 1


def _drop_stdout() -> None:
    """Point stdout at /dev/null after it failed, so that the interpreter's flush of what its
    buffer still holds at exit does not fail again ("Exception ignored ...", status 120)."""
    if sys.stdout is not None:
        _to_devnull(sys.stdout.fileno)


def _to_devnull(fileno) -> None:
    """Point the file descriptor ``fileno()`` gives at /dev/null (nothing where that fails)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _Diagnostics:
    """The command's ``sys.stderr`` (see :func:`entry`): ``stream``, but a write or flush that
    fails (stderr closed or read-only, ``2>&-`` through a shell script; a full disk,
    ``2>/dev/full``; a reader that went away) drops its text, and from then on file descriptor 2
    is /dev/null (for what C libraries write there, and the interpreter's flush at exit):
    stderr carries diagnostics only, and the command goes on (stdout is its product). ``error``:
    the first write or flush that failed (None: none did). Bench's stdout is one too, for the
    same reason (its files are its product: :func:`stdout_kept_going`). Any other attribute is
    ``stream``'s."""

    def __init__(self, stream):
        self._stream = stream
        self.error: OSError | None = None  # (the first write or flush that failed)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._drop(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._drop(exc)

    def _drop(self, exc: OSError) -> None:
        if self.error is None:
            self.error = exc
        _to_devnull(self._stream.fileno)
        try:  # (what its buffer still holds goes to /dev/null)
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _quiet_stderr() -> None:
    """Make ``sys.stderr`` a :class:`_Diagnostics`; where the process started with stderr closed
    (``2>&-``: ``sys.stderr`` is None, and ``print(file=None)`` writes to stdout), over file
    descriptor 2 pointed at /dev/null first (the next file opened would get it, and what C
    libraries write there)."""
    if sys.stderr is None:
        try:
            os.fstat(2)
        except OSError:
            _to_devnull(lambda: 2)
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (the process's, to its end)
    sys.stderr = _Diagnostics(sys.stderr)


_interrupts_raised: int | None = None  # the KeyboardInterrupts _on_sigint raised (None: it raises none)
_last_raised = 0.0  # when it raised the last one (time.monotonic(), seconds)
INSIST_S = 1.0  # a Ctrl-C this long after the last one raised interrupts again (seconds)


def _on_sigint(signum, frame) -> None:
    """The command's SIGINT handler (see :func:`entry`): the first Ctrl-C raises
    ``KeyboardInterrupt``; a second one does while a call still runs on the compute thread
    (:func:`dflash_torch.compute.busy`: it stops waiting for that call, and the process exits
    at once), and any one ``INSIST_S`` seconds or more after the last raised (the command
    went on: an import swallowed it, trial-146, or its clean-up takes long); the quick
    ones of a burst are ignored, so that none interrupts the command's clean-up."""
    import time

    global _interrupts_raised, _last_raised
    if _interrupts_raised is None:
        return
    compute = sys.modules.get(f"{__package__}.compute")
    if _interrupts_raised == 0 or (_interrupts_raised == 1 and compute is not None and compute.busy()) \
            or time.monotonic() - _last_raised >= INSIST_S:
        _interrupts_raised += 1
        _last_raised = time.monotonic()
        raise KeyboardInterrupt


def interrupt_again() -> None:
    """After a Ctrl-C that the command handled and went on from, once it has moved on to new
    work (chat: the next reply has begun to stream): the next Ctrl-C interrupts it again, as the
    first did (see :func:`entry`). Until then the quick ones of the first one's burst stay
    ignored (chat's prompt after an interrupted reply: a second press would end the chat)."""
    global _interrupts_raised
    if _interrupts_raised is not None:
        _interrupts_raised = 0


def _on_unraisable(unraisable) -> None:
    """The command's ``sys.unraisablehook``: a Ctrl-C (or a SIGTERM that interrupts as one:
    :func:`terminate_as_interrupt`) that arrives just as its signal is set to be ignored, CPython reports ("OSError: Signal 2 ignored due to race condition"); ignored is
    what the command meant, so that report is dropped. Any other goes to Python's hook."""
    if str(unraisable.exc_value) not in (f"Signal {signum.value} ignored due to race condition"
                                         for signum in (signal.SIGINT, signal.SIGTERM)):
        sys.__unraisablehook__(unraisable)


# the commands that stop on SIGINT where they were started with it ignored, as a shell without job control starts a
# command in the background (`dflash-torch train ... &` from a script): `kill -INT PID` stopped serve, but train
# trained on to its last step (trial-293 d), as bench ran on, and generate and chat (a chat fed by a pipe) went on to
# their end, status 0 (trial-304 e): every command that runs long
BACKGROUND_COMMANDS = ("serve", "train", "bench", "generate", "chat")


def entry() -> None:
    """The ``dflash-torch`` command: :func:`main`, then exit with its status. Ctrl-C (SIGINT)
    raises ``KeyboardInterrupt`` once (the command then ends with status 130); a quick run of
    further ones is ignored rather than raising tracebacks from the clean-up it interrupts or
    from the exit callbacks ("Exception ignored in atexit callback"), except one that stops
    waiting for a call on the compute thread (see :func:`dflash_torch.compute.run`). Where
    such a call still runs, the process exits without finalizing the interpreter, which
    would stop that thread inside a torch op and abort the process ("terminate called
    without an active exception"); so it does where a download still runs
    (:func:`dflash_torch.hub.downloading`), which would hold up the exit until the file it
    fetches ends, and where a server's thread still tokenizes a prompt
    (:func:`dflash_torch.serving.app.busy`: its request was answered, the tokenizing would hold
    up the exit for as long as it runs). A process started with SIGINT ignored keeps it ignored,
    but for the commands of :data:`BACKGROUND_COMMANDS`, which SIGINT stops from their start as it
    does in the foreground (``serve``: once up, uvicorn stops on SIGINT whatever it inherited, so
    its start-up, torch's import included, does too). Lines that stderr cannot take are dropped
    (:class:`_Diagnostics`)."""
    global _interrupts_raised
    _quiet_stderr()
    if sys.argv[1:2] and sys.argv[1] in BACKGROUND_COMMANDS and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (serve: uvicorn's SIGINT raised again once shut
        # down, 130; train: its checkpoint saved, 130)
    installed = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if installed:
        _interrupts_raised = 0
        sys.unraisablehook = _on_unraisable
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        code = main()
    except SystemExit as exc:  # (train's Ctrl-C: SystemExit(130) once its checkpoint is saved)
        code = exc.code
    except KeyboardInterrupt:  # (one that lands after main's own handling)
        code = 130
    finally:
        _interrupts_raised = None  # (the command has ended: a Ctrl-C now is ignored)
    if installed:  # (and stays ignored while the interpreter finalizes, which would set a Python handler's
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # signal back to its default action: killed by SIGINT)
    compute = sys.modules.get(f"{__package__}.compute")  # (not imported: nothing ran there; nor is torch loaded)
    hub = sys.modules.get(f"{__package__}.hub")  # (a download a Ctrl-C left: its threads would hold up the exit)
    serving = sys.modules.get(f"{__package__}.serving.app")  # (a server's tokenizing left by a Ctrl-C: the same)
    if (compute is not None and compute.busy()) or (hub is not None and hub.downloading()) or \
            (serving is not None and serving.busy()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # (python -m dflash_torch.cli: the package's module runs it, whose state chat shares)
    from dflash_torch.cli import entry as _entry

    _entry()
