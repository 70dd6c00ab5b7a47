"""User-facing errors.

Every mistake a user can make (bad paths, incompatible target/drafter, invalid
sampling parameters, context overflow, unsupported dtype) raises
:class:`DFlashError` with a one-line message. The CLI prints that line and exits
non-zero; the server turns it into an HTTP 400. An error about one option's value is an
:class:`OptionError`, which says how its message spells the option, so that the command
line can name the flag the user typed (``--max-new-tokens``) rather than the Python
argument (``max_new_tokens``).
"""

import re


class DFlashError(ValueError):
    """A user error with a one-line, human-readable message."""


class OptionError(DFlashError):
    """A :class:`DFlashError` about the value of one option (or of a few together);
    ``name`` is the option's name as the message spells it (``max_new_tokens``,
    ``block size``), ``names`` that name and the others the message spells."""

    def __init__(self, message: str, name: str, *others: str):
        super().__init__(message)
        self.name = name
        self.names = (name, *others)

    def __reduce__(self):  # (pickled with its names: an error raised in a worker process comes back whole)
        return type(self), (str(self), *self.names), self.__dict__


def name_pattern(name: str) -> str:
    """The regular expression of the option ``name`` as a word of an :class:`OptionError`'s
    message: not inside a path or a longer name (``out`` in ``out /tmp/out``: the first
    only), not next to a quote (a path shown by :func:`quoted`: ``'my out'``) and not
    followed by a dot and a word character (``resume.d``); ``name=True`` (a bool field set,
    in the Python API) is matched whole, as the command line's flag without a value stands
    for it."""
    return rf"(?<![\w./\\'\"-]){re.escape(name)}(?:=True)?(?![\w/\\'\"-]|\.\w)"


def quoted(path) -> str:
    """``path`` (a str or os.PathLike) as a message shows it: in quotes, Python's ``repr`` of
    its text (``'my out'``), so that its words are not read as option names
    (:func:`name_pattern`) nor its spaces as the message's."""
    return repr(str(path.__fspath__() if hasattr(path, "__fspath__") else path))


# a quoted text of a message (a path shown by quoted, a value by shown): its words are not option names. Its
# opening quote follows no word character (the apostrophe of "run's" opens none)
_QUOTED = r"(?<!\w)'(?:[^'\\\n]|\\.)*'|(?<!\w)\"(?:[^\"\\\n]|\\.)*\""


def name_spans(message: str, name: str) -> list[tuple[int, int]]:
    """The (start, end) character spans of the option ``name`` in ``message``, each a word of
    its own (:func:`name_pattern`) outside quoted text (``'my out'``, a path shown by
    :func:`quoted`), in order."""
    pattern = re.compile(rf"{_QUOTED}|(?P<name>{name_pattern(name)})")
    return [m.span("name") for m in pattern.finditer(message) if m.group("name") is not None]


def named(message: str, *names: str) -> OptionError:
    """An :class:`OptionError` of ``message`` about the options ``names``, each listed as
    often as the message names it (:func:`name_pattern`), so that the command line names
    each occurrence by its flag (``lower batch or seq_len ... seq_len 64`` -> ``lower
    --batch or --seq-len ... --seq-len 64``)."""
    listed = [n for n in names for _ in range(max(1, len(name_spans(message, n))))]
    return OptionError(message, *listed)


class ContextLengthError(DFlashError):
    """A prompt, or a prompt with the tokens asked of it, that does not fit the model's context;
    the server answers it with OpenAI's error code ``context_length_exceeded``, by which
    clients tell it from other bad requests (to shorten a conversation, say)."""

    code = "context_length_exceeded"


class ContextOptionError(OptionError, ContextLengthError):
    """A :class:`ContextLengthError` about options (the prompt, ``max_new_tokens``,
    ``max_context``, ``min_tokens``), named as an :class:`OptionError` names them."""


class CompileError(DFlashError):
    """``torch.compile`` failed to build a compiled decoding step's graph (``compile=True``,
    ``--compile``): a damaged compile cache, no working C++ compiler, a C++ compile or link
    that failed, a compile cache directory torch cannot create or write. Not the input's
    fault: the command line exits 1 (not 2), the server answers 500. The message is one line
    with torch's reason (a compiler's first error line, an ``OSError``'s path and reason) and,
    where the reason tells, what to do (:func:`~dflash_torch.decoding.compile_failure`);
    torch's own error is its ``__cause__``."""


class OutputError(Exception):
    """The command line's stdout cannot take the output (closed, or its disk full): one line
    on stderr, exit status 1 (not a user error)."""


def about_prompt(message: str, i: int) -> str:
    """``message`` said of prompt ``i`` of several: ``prompt i: message``, or where the
    message begins with ``prompt (`` (its length in tokens), ``prompt i (...``."""
    return f"prompt {i} {message[len('prompt '):]}" if message.startswith("prompt (") else f"prompt {i}: {message}"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name where it has none), for an error
    line that names what went wrong inside a library."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def shown(value) -> str:
    """``value`` as an error message shows it: its ``repr``, but an integer of over 20 digits by
    its size (Python refuses to print one of over 4,300 digits, ``sys.get_int_max_str_digits``,
    which would turn the message itself into a ``ValueError``)."""
    if isinstance(value, int) and not -10**20 < value < 10**20:
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    try:
        return repr(value)
    except ValueError:  # (a list or dict holding such an integer)
        return f"a {type(value).__name__} holding an integer too long to print"


def unprintable(value, depth: int = 0) -> bool:
    """Whether ``value`` is, or holds (in a list, tuple, set or dict's values, two levels down), an
    integer of over about 3,900 digits, which an error message could not print (see :func:`shown`;
    dict keys, ``logit_bias``'s token ids, are shown by it where their check names them)."""
    if isinstance(value, int):
        return value.bit_length() > 13_000
    if depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
        return any(unprintable(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(unprintable(v, depth + 1) for v in value.values())
    return False
