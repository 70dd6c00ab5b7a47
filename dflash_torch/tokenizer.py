"""Loading a model's tokenizer (transformers' ``AutoTokenizer``), with one-line errors for
the ways a checkpoint's tokenizer files go wrong, and facts about a tokenizer the engine
needs: the byte-level BPE alphabet and the longest text that can fit a context.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from .checkpoint import check_links, read_json_object
from .errors import DFlashError, OptionError
from .models.config import quiet_transformers


def byte_level_alphabet() -> list[str]:
    """The character that byte-level BPE (GPT-2's scheme, used by Qwen and Llama 3) spells
    each byte 0..255 with: printable Latin-1 bytes (33-126, 161-172, 174-255) as
    themselves, the other 68 as U+0100, U+0101, ... in byte order."""
    kept = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in kept:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


NORMALIZATION_SHRINK = 4  # Unicode normalization (NFC, NFKC) composes at most 4 code points into one


def max_prompt_chars(tokenizer, max_context: int) -> int:
    """Characters beyond which a text cannot fit ``max_context`` tokens.

    No token stands for more input characters than the length of its string in the
    vocabulary (byte-level BPE spells a token with one character per byte: bytes >=
    characters), so a text of more than ``max_context * L`` characters, L the longest
    token string, has more than ``max_context`` tokens. A tokenizer that normalizes its
    input first may compose characters (NFC, NFKC: up to 4 into 1, U+1F82), hence the
    margin then. (A normalizer that deletes characters, such as BERT's clean-up, is not
    covered; the supported families use none: Qwen NFC, Llama 2 replace/prepend, Llama 3 none.)
    """
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = 1 if backend is not None and backend.normalizer is None else NORMALIZATION_SHRINK
    return max_context * longest * shrink


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")  # (named when the tokens are missing)
TOKENIZER_READ = (*VOCABULARY_FILES, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "chat_template.jinja")  # (tried when loading fails: the tokenizers library's errors do not name the file)


def _check_sentencepiece(model_dir: Path) -> None:
    """Refuse, in one line, a tokenizer only a SentencePiece ``tokenizer.model`` holds where the
    sentencepiece package is not installed (an older Llama / Mistral repository without a
    ``tokenizer.json``). transformers then logs five lines and falls back to reading the file as
    tiktoken's, whose error says to install tiktoken, which cannot read it either. A tiktoken
    ``tokenizer.model`` (text: a base64 token and its rank a line, as Llama 3's original one) is
    left to transformers.

    Raises:
        DFlashError: as above, naming the package to install.
    """
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "vocab.json")) or importlib.util.find_spec(
            "sentencepiece") is not None:
        return
    try:
        with open(model_dir / "tokenizer.model", "rb") as f:
            head = f.read(64)
    except OSError:  # (absent, or unreadable: as transformers finds it)
        return
    if head and not re.fullmatch(rb"[A-Za-z0-9+/=]+ [0-9]+\r?\n.*", head, re.DOTALL):
        raise DFlashError(f"the tokenizer of {model_dir} is a SentencePiece tokenizer.model (no tokenizer.json beside "
                          f"it), which needs the sentencepiece package: pip install sentencepiece")


def transformers_config(model_dir: Path):
    """transformers' config object of the checkpoint in ``model_dir``, read from its
    ``config.json`` as ``AutoTokenizer`` reads it (``AutoConfig``; the base ``PreTrainedConfig``
    where that raises ``ValueError`` or ``OSError``, a ``model_type`` it does not know), for
    transformers' tokenizer and model loaders to be given. A top-level ``dtype`` /
    ``torch_dtype`` "auto", which the config class alone cannot read (its model loader is given
    a dtype), is read as absent. transformers' log lines and warnings on the file (a YaRN
    factor that disagrees with ``max_position_embeddings``, rope keys it does not know, a
    deprecated ``torch_dtype``) are silenced: dflash-torch reads the file itself and says what
    matters to it (see ``models.config``).

    Raises:
        whatever transformers raises on the file (its config class refusing a field:
        ``huggingface_hub.errors.StrictDataclassError``; an unreadable file: ``OSError``);
        DFlashError: a config.json that is not a JSON object.
    """
    from transformers import AutoConfig, PreTrainedConfig

    config_file = Path(model_dir) / "config.json"
    auto = config_file.is_file() and "auto" in (read_json_object(config_file).get(k) for k in ("dtype", "torch_dtype"))
    given = {"dtype": None, "torch_dtype": None} if auto else {}
    with quiet_transformers():
        try:
            return AutoConfig.from_pretrained(str(model_dir), **given)
        except (ValueError, OSError):
            return PreTrainedConfig.from_pretrained(str(model_dir), **given)


def check_tokenizer_size(tokenizer, vocab_size: int, model_dir: Path | None = None) -> None:
    """Refuse a tokenizer that is not one of a target of ``vocab_size`` tokens: one of more
    tokens (ids the target has no row for), or of fewer than half as many (the target would
    emit ids it cannot decode). A real tokenizer is at most a little smaller than its
    model's embedding, padded to a round size (Qwen: 151,669 tokens, vocab_size 151,936);
    transformers builds a tokenizer of its special tokens alone from a
    ``tokenizer_config.json`` whose vocabulary files are missing, as a partial download
    leaves it.

    Args:
        model_dir: the checkpoint the tokenizer was loaded from, if any: too few tokens then
            names its vocabulary file, else the files missing.

    Raises:
        DFlashError: a size that does not fit ``vocab_size``, one line; too many tokens names
            those past it (an added ``[PAD]``, as Llama-2's and Mistral's recipes add one).
    """
    if len(tokenizer) > vocab_size:
        raise DFlashError(f"the tokenizer has {len(tokenizer)} tokens but the target's vocab_size is {vocab_size}"
                          f"{_tokens_past(tokenizer, vocab_size)}")
    if 2 * len(tokenizer) < vocab_size:
        if model_dir is None:
            raise DFlashError(f"the tokenizer has {len(tokenizer)} token{'s' if len(tokenizer) != 1 else ''}, far fewer "
                              f"than the target's vocab_size ({vocab_size}): not the target's tokenizer?")
        absent = [f for f in VOCABULARY_FILES if not (Path(model_dir) / f).is_file()]
        whole = [f for f in VOCABULARY_FILES[:2] if f not in absent] or (["vocab.json and merges.txt"] if not (
            {"vocab.json", "merges.txt"} & set(absent)) else [])
        if whole:  # (a vocabulary is there, not too few files: listing the others as missing misled)
            raise DFlashError(f"the tokenizer of {model_dir} has {len(tokenizer)} token{'s' if len(tokenizer) != 1 else ''}"
                              f", far fewer than the target's vocab_size ({vocab_size}): too few for this target (a "
                              f"wrong or incomplete {whole[0]}?)")
        absent = f"no {', '.join(absent[:-1])} or {absent[-1]}; " if len(absent) > 1 else f"no {absent[0]}; " if absent else ""
        raise DFlashError(f"the tokenizer of {model_dir} has {len(tokenizer)} token{'s' if len(tokenizer) != 1 else ''}"
                          f", far fewer than the target's vocab_size ({vocab_size}): its vocabulary files are missing "
                          f"or incomplete ({absent}an interrupted download?)")


def _tokens_past(tokenizer, vocab_size: int) -> str:
    """``": its tokens 320..323 ('a', 'b', 'c', ...) have no row in the target's embedding"``:
    the tokens of ``tokenizer`` whose ids are ``vocab_size`` or more ("added" where the
    tokenizer has them as added tokens); "" where it names none."""
    past = sorted((i, t) for t, i in tokenizer.get_vocab().items() if i >= vocab_size)
    if not past:
        return ""
    get_added = getattr(tokenizer, "get_added_vocab", None)
    added = set(get_added().values()) if callable(get_added) else set()
    kind = "added token" if all(i in added for i, _ in past) else "token"
    ids = f"{kind} {past[0][0]}" if len(past) == 1 else f"{kind}s {past[0][0]}..{past[-1][0]}"
    names = ", ".join(repr(t) for _, t in past[:3]) + (", ..." if len(past) > 3 else "")
    return f": its {ids} ({names}) {'has' if len(past) == 1 else 'have'} no row in the target's embedding"


def load_tokenizer(model_dir: Path, vocab_size: int | None = None, name: str | None = None):
    """The target's tokenizer via ``AutoTokenizer``.

    Args:
        name: the argument that named ``model_dir`` (``target``), if any: each error below is
            then an OptionError led by it, as the argument's other errors are
            (:func:`~dflash_torch.checkpoint.checkpoint_dir`: ``--target: DIR has no ...``).
        vocab_size: the target's; where given, a tokenizer of more tokens, or of fewer than
            half as many, is refused. (A real tokenizer is at most a little smaller than its
            model's embedding, padded to a round size; transformers builds a tokenizer of its
            special tokens alone from a ``tokenizer_config.json`` whose vocabulary files are
            missing, as a partial download leaves it.)

    Raises:
        DFlashError: no tokenizer files in the checkpoint (naming the Hub id of a snapshot in the
            Hugging Face cache), a file that is a broken link (of an interrupted download; but not
            a generation config or chat template of a snapshot in the Hugging Face cache:
            :func:`dflash_torch.hub.snapshot` warned it is used without), a tokenizer that fails to
            load (``cannot read FILE: Permission denied`` where a tokenizer file is one this process may not read; one that the
            tokenizer does not need is no error; a tokenizer JSON file that is not a valid JSON
            object, named), a config.json that
            transformers' config class refuses (AutoTokenizer reads it too; a top-level ``dtype`` /
            ``torch_dtype`` "auto", which that class alone cannot read, is read as absent), a size that does
            not fit ``vocab_size`` (see above; too few tokens names the vocabulary file where
            there is one, else the files missing), a tokenizer file (tokenizer_config.json, ...)
            that is a directory (transformers reads it as absent, or advises installing
            sentencepiece or tiktoken). A SentencePiece ``tokenizer.model`` without the sentencepiece
            package: see ``_check_sentencepiece``.
    """
    try:
        return _load_tokenizer(model_dir, vocab_size)
    except DFlashError as exc:  # (only the no-files one was led by --target: trial-320, trial-325)
        if not name:
            raise
        raise OptionError(f"{name}: {exc}", name) from None


def _load_tokenizer(model_dir: Path, vocab_size: int | None):
    """:func:`load_tokenizer`'s work, its errors DFlashErrors that do not name the argument."""
    from transformers import AutoTokenizer

    from .hub import OPTIONAL_FILES, cached_name, offline_variable

    hub_id = cached_name(model_dir)

    def lacking(missing: str) -> DFlashError:  # (files missing or broken: with the snapshot's id)
        if hub_id:
            from huggingface_hub import constants

            missing += (f"; it is the snapshot of {hub_id} in the Hugging Face cache"
                        # (not "kept from being completed": the repo may lack them too, trial-328)
                        + (f"; {offline_variable()} is set, so nothing was downloaded (where its repo holds the "
                           f"files missing, loading {hub_id} with it unset fetches them)"
                           if constants.HF_HUB_OFFLINE else ""))
        return DFlashError(missing)

    # (else transformers blames a missing sentencepiece for a missing tokenizer.json; a Hub snapshot's generation config
    # or chat template whose blob is gone is used without, as hub.snapshot warned: transformers reads it as absent)
    try:
        check_links(model_dir, passed=OPTIONAL_FILES if hub_id else ())
    except DFlashError as exc:
        raise (lacking(str(exc)) if "broken link" in str(exc) else exc) from None
    if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise lacking(f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    for file in TOKENIZER_READ:  # (transformers skips a directory of a file's name as if the file were absent)
        if (Path(model_dir) / file).is_dir():
            raise DFlashError(f"cannot load the tokenizer of {model_dir}: its {file} is a directory, not a file")
    _check_sentencepiece(Path(model_dir))
    try:  # (the config read here, not by AutoTokenizer: its notices on the file are silenced)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), config=transformers_config(model_dir))
    except DFlashError:  # (a config.json that is not a JSON object, named)
        raise
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        if isinstance(exc, PermissionError) and exc.filename:  # (a file this process may not read)
            raise DFlashError(f"cannot read {exc.filename}: {exc.strerror}") from None
        for file in TOKENIZER_READ:  # (an unreadable vocab.json was "Error while initializing BPE: Permission denied";
            try:                     # looked for only now: one it does not need, beside a tokenizer.json, is fine)
                open(Path(model_dir) / file, "rb").close()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise DFlashError(f"cannot read {Path(model_dir) / file}: {e.strerror}") from None
            if file.endswith(".json") and (Path(model_dir) / file).is_file():  # (its JSON error named no file)
                read_json_object(Path(model_dir) / file)
        detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # (one line, all of it)
        if type(exc).__name__.startswith("StrictDataclass"):  # (its config class refused config.json: a field, or them together)
            raise DFlashError(f"transformers refuses {Path(model_dir) / 'config.json'} (AutoTokenizer reads it to load "
                              f"the tokenizer): {detail}") from None
        if not any((Path(model_dir) / f).is_file() for f in VOCABULARY_FILES[:3]):  # (transformers' reason then
            # advises installing sentencepiece or tiktoken, which cannot help: the vocabulary is not there)
            reason = "" if "Couldn't instantiate the backend tokenizer" in detail else f": {detail or type(exc).__name__}"
            raise lacking(f"cannot load the tokenizer of {model_dir}, which has no {', '.join(VOCABULARY_FILES[:2])} or "
                          f"{VOCABULARY_FILES[2]} (an incomplete download?){reason}") from None
        raise DFlashError(f"cannot load the tokenizer of {model_dir}: {detail or type(exc).__name__}") from None
    if vocab_size is not None:
        check_tokenizer_size(tokenizer, vocab_size, Path(model_dir))
    return tokenizer
