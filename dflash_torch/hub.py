"""Hugging Face Hub ids (``ORG/NAME``, or ``ORG/NAME@REVISION`` for a branch, tag or commit hash
of the repo, e.g. ``Qwen/Qwen3-8B@main``, ``acme/model@v2``, ``acme/model@refs/pr/3``; without
one, its ``main`` branch): their snapshot in the local Hugging Face cache, or a download into it
with ``huggingface_hub`` (unless ``HF_HUB_OFFLINE`` is set).

A snapshot in the cache that holds a ``config.json`` and its safetensors weights is used as
it is, with no network (``hf download ORG/NAME`` updates it); one without them (a download cut
short, or files fetched by other tools, e.g. only the tokenizer) is completed by a download.
Only the files loading reads are fetched (:data:`HUB_FILES`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from .errors import DFlashError, first_line

# The files of a Hub repo that loading reads: config, generation config, weights and their index,
# tokenizer and chat template files; HUB_SKIPPED leaves out every subfolder (e.g. gpt-oss's original/,
# whose consolidated weights would double the download).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
HUB_SKIPPED = ["*/*"]
# files loading reads where a repo has them, whose absence changes what it does (the generation config's
# EOS ids and sampling defaults, the chat template): a cached snapshot lacking one its repo has is completed
OPTIONAL_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json")

# huggingface_hub's environment variables that it reads with int() when it is imported (seconds)
HUB_TIMEOUTS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")

_downloads: set[threading.Event] = set()  # each download's "finished", until its caller has seen it end


def check_timeouts() -> None:
    """Refuse a :data:`HUB_TIMEOUTS` variable that is set but not an integer (``abc``, ``2.5``,
    empty): huggingface_hub reads it with ``int()`` when it is imported, which transformers does
    for any model, a local directory too (a ValueError traceback). An integer it takes is left to
    it (0: its default; a negative one: the download's error).

    Raises:
        DFlashError: naming the variable, its value, and that it must be an integer of seconds."""
    for var in HUB_TIMEOUTS:
        value = os.environ.get(var)
        try:
            if value is not None:
                int(value)
        except ValueError:
            raise DFlashError(f"{var}={value!r}: it must be an integer number of seconds (huggingface_hub reads it), "
                              f"e.g. {var}=10, or unset") from None


def split_revision(name: str) -> tuple[str, str | None]:
    """``(repo id, revision)`` of ``ORG/NAME@REVISION`` (split at the first ``@``: a revision
    such as ``refs/pr/3`` holds slashes); ``(name, None)`` without an ``@``."""
    repo, at, revision = name.partition("@")
    return (repo, revision) if at else (name, None)


def _valid_revision(revision: str) -> bool:
    """Whether ``revision`` may name a git branch, tag or commit (``git check-ref-format``'s
    rules, in short): one that may not (``..``, ``./v2``) would be read as a path, in the
    Hub's URLs (``@..`` gave ``main``) and in the cache's ``refs`` folder; nor may ``@`` alone
    (``ORG/NAME@@``: git's word for HEAD)."""
    parts = revision.split("/")
    return (not any(c.isspace() or c in "~^:?*[\\" or ord(c) < 32 or ord(c) == 127 for c in revision)
            and ".." not in revision and "@{" not in revision and revision != "@" and not revision.endswith(".lock")
            and all(part and not part.startswith(".") for part in parts))


def snapshot(name: str) -> Path:
    """The local directory of the Hub repo ``name`` (``ORG/NAME``, or ``ORG/NAME@REVISION``: that
    branch, tag or commit hash; else ``main``): its snapshot of that revision in the cache when
    that holds ``config.json`` and safetensors weights (whatever else of the repo it lacks, e.g.
    after ``hf download --include``; but unless ``HF_HUB_OFFLINE`` is set, one that lacks a
    tokenizer file the repo's file list that huggingface_hub keeps names is completed (see
    :func:`_lacks_tokenizer`); and one that lacks an :data:`OPTIONAL_FILES` file the list names,
    or holds a broken link to one, is completed where the Hub may be reached, else (offline
    too, without trying) used without it, with a WARNING line), else the snapshot
    :func:`download` fills.

    Raises:
        DFlashError: ``name`` is not a valid repo id (``ORG/NAME`` of letters, digits, ``-``,
            ``_``, ``.``, with an optional ``@REVISION``), or its revision after ``@`` is empty or
            not a git branch, tag or commit name (``..``, ``./v2``, ``@``, whitespace);
            a part of its cache entry this process may not read; see :func:`download` (not
            cached and offline, no such revision, ...), with what the cache holds instead where it
            holds something near (:func:`_cached_instead`: the complete snapshot of another commit
            where ``refs/main`` names one missing or partial, an id or revision that differs in
            case, a close id, the commit a revision of hex digits begins).
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, revision = split_revision(name)
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise DFlashError(f"model {name!r} is not a local directory, nor a Hugging Face id (ORG/NAME[@REVISION]: "
                          "letters, digits, '-', '_' and '.', then optionally a branch, tag or commit hash)") from None
    if revision is not None and not revision.strip():
        raise DFlashError(f"model {name!r} names no revision after '@' (ORG/NAME@REVISION: a branch, tag or commit hash; "
                          "ORG/NAME alone is the main branch)")
    if revision is not None and not _valid_revision(revision):
        raise DFlashError(f"model {name!r}: {revision!r} is not a branch, tag or commit name (git's rules: no "
                          "whitespace, no '..', no part that is empty or starts with '.', none of ~ ^ : ? * [ \\, "
                          "not '@' alone)")
    try:  # (the cache first: no network for a model already there)
        local = snapshot_download(repo_id=repo, revision=revision, local_files_only=True, allow_patterns=HUB_FILES,
                                  ignore_patterns=HUB_SKIPPED)
        listed = False
    except Exception as exc:  # (IncompleteSnapshotError, huggingface_hub >= 2: the snapshot lacks a file of the repo's
        # stored file list, e.g. a README.md or merges.txt that loading does not read: what it holds is judged below)
        local = getattr(exc, "snapshot_path", None)
        listed = local is not None
    lacks = optional = None
    if local is not None:
        try:  # (a shared cache whose snapshot or blobs this process may not read)
            os.listdir(local)
            lacks = _lacks(Path(local))
            if lacks is None:
                files = _listed(repo, revision) if listed else set()  # (the repo's file list huggingface_hub keeps)
                if not constants.HF_HUB_OFFLINE:  # (a download completes it; offline, loading says what it lacks)
                    lacks = _lacks_tokenizer(Path(local), files)
                optional = None if lacks is not None else [  # (a broken link to one: the repo has it, its blob is gone)
                    f for f in OPTIONAL_FILES if (f in files or (Path(local) / f).is_symlink())
                    and not (Path(local) / f).is_file()]
        except OSError as exc:
            raise DFlashError(f"cannot read {exc.filename or local}: {exc.strerror}") from None
        if lacks is None and optional:
            what = _named(Path(local), optional)
            try:  # (a generation config or chat template the repo has: fetched where it may be, else done without;
                # offline, download says so at once, and loading passes over a broken link to one: load_tokenizer)
                return download(name, cached=f"{local} lacks {what}")
            except DFlashError as exc:
                logging.getLogger("dflash_torch").warning(
                    f"dflash-torch: WARNING: the cached snapshot of {name} lacks {what}, which the repo "
                    f"has, and it cannot be downloaded: it is used without ({exc})")
        if lacks is None:
            return Path(local)
    denied = _unreadable_cache_entry(repo, revision)
    if denied is not None:
        raise DFlashError(f"cannot read {denied}: Permission denied")
    if local is None and lacks is None:  # (refs/main names a commit whose snapshot is not there: an update cut short)
        lacks = _ref_without_snapshot(repo, revision)
    try:
        return download(name, cached=lacks)
    except DFlashError as exc:  # (what the cache holds instead: a complete earlier commit, a near id or revision)
        hint = _cached_instead(repo, revision, local)
        if hint is None:
            raise
        raise DFlashError(f"{exc}; {hint}") from None


def _repo_folder(repo: str) -> Path:
    """The Hugging Face cache folder of the Hub repo ``repo`` (``ORG/NAME``):
    ``HF_HUB_CACHE/models--ORG--NAME``."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--"))


def _ref_without_snapshot(repo: str, revision: str | None) -> str | None:
    """Where the cache's ``refs/REVISION`` (``refs/main`` without one) of ``repo`` names a commit
    that has no snapshot folder (huggingface_hub writes the ref before the files: an update cut
    short): that, in a line; else None."""
    folder = _repo_folder(repo)
    try:
        commit = (folder / "refs" / (revision or "main")).read_text().strip()
        if not _is_commit(commit) or (folder / "snapshots" / commit).exists():
            return None
    except (OSError, UnicodeDecodeError):  # (a refs file that is no text: loading says what is wrong, trial-328)
        return None
    return (f"its refs/{revision or 'main'} names commit {commit}, whose snapshot is not there: an update cut short?")


def _complete_snapshots(repo: str, revision: str | None = None) -> list[str]:
    """The commits of ``repo`` whose snapshots in the cache are complete (:func:`_complete`),
    newest first, less those that another ref than ``revision`` (None: ``main``) names (another
    branch's or tag's: pasted as ``ORG/NAME@COMMIT`` they would load that revision, trial-328);
    none where the cache cannot be read."""
    folder = _repo_folder(repo)
    try:
        others = {r.read_text().strip() for r in (folder / "refs").rglob("*")
                  if r.is_file() and r.relative_to(folder / "refs").as_posix() != (revision or "main")}
        found = [(d.stat().st_mtime, d.name) for d in (folder / "snapshots").iterdir()
                 if _is_commit(d.name) and d.name not in others and _complete(d)]
    except (OSError, UnicodeDecodeError):
        return []
    return [name for _, name in sorted(found, reverse=True)]


def _cached_instead(repo: str, revision: str | None, local: str | os.PathLike | None) -> str | None:
    """What the Hugging Face cache holds that ``repo`` at ``revision`` (None: ``main``) likely
    means, where that is not in it (or not whole, ``local`` its incomplete snapshot, if any), in
    words to append to an error: a complete snapshot of another commit of it where the cache
    knows the revision (its ``refs`` file names a commit missing or incomplete: an update cut
    short), ``ORG/NAME@COMMIT`` to load it; a cached repo whose id differs in case only, or is a
    close match (:func:`difflib.get_close_matches`); a cached ref that differs in case only,
    or the commit a revision of hex digits begins; else None. Reads only the cache."""
    import difflib

    from huggingface_hub import constants

    folder = _repo_folder(repo)
    if (folder / "refs" / (revision or "main")).is_file():
        held = [c for c in _complete_snapshots(repo, revision) if local is None or c != Path(local).name]
        if held:
            commits = ", ".join(held[:3]) + (" ..." if len(held) > 3 else "")
            return (f"the cache holds {'a complete snapshot' if len(held) == 1 else 'complete snapshots'} of "
                    f"{'another commit' if len(held) == 1 else 'other commits'} of it that no other branch or tag "
                    f"names ({commits}, an earlier {revision or 'main'}?): "
                    f"{repo}@{held[0]} loads {'it' if len(held) == 1 else 'the newest'}")
        return None
    if folder.is_dir():  # (the repo is cached; the revision is not)
        if revision is None:
            return None
        try:
            refs = [r.relative_to(folder / "refs").as_posix() for r in (folder / "refs").rglob("*") if r.is_file()]
            commits = [d.name for d in (folder / "snapshots").iterdir() if _is_commit(d.name)]
        except (OSError, UnicodeDecodeError):
            return None
        same = [r for r in refs if r.lower() == revision.lower()]
        begun = [c for c in commits if len(revision) >= 4 and c.startswith(revision.lower())]
        meant = same or begun
        if len(meant) != 1:
            return None
        what = "a branch or tag the cache holds" if same else f"the commit the cache holds that {revision!r} begins"
        return f"did you mean {repo}@{meant[0]}? ({what})"
    try:
        names = [n for n in map(_folder_id, (d.name for d in Path(constants.HF_HUB_CACHE).iterdir())) if n]
    except OSError:
        return None
    names = [n for n in names if n.isprintable()]  # (a folder name that is no text is nobody's id)
    same = [n for n in names if n.lower() == repo.lower()]
    # (a close match whose digits differ is another model, not a typo: Qwen3-8B is not Qwen3-4B, trial-328)
    digits = lambda text: re.sub(r"\D+", " ", text).split()  # noqa: E731
    close = [n for n in difflib.get_close_matches(repo, names, n=3, cutoff=0.8) if digits(n) == digits(repo)]
    meant = (same or close)[:1]
    if not meant:
        return None
    other = _repo_folder(meant[0])
    if revision is not None and not ((other / "refs" / revision).is_file()
                                     or (_is_commit(revision) and (other / "snapshots" / revision).is_dir())):
        return f"did you mean {meant[0]}? (the Hugging Face cache holds it, though not at {revision!r})"
    at = "" if revision is None else f"@{revision}"
    return f"did you mean {meant[0]}{at}? (the Hugging Face cache holds {meant[0]})"


def _complete(local: Path) -> bool:
    """Whether a cached snapshot holds ``config.json`` and the safetensors weights loading reads
    (a link to a blob that is not there, left by a download cut short, is not held).

    Raises:
        OSError: a part of it this process may not read."""
    from .checkpoint import read_json_object

    if not (local / "config.json").is_file():
        return False
    if (local / "model.safetensors").is_file():
        return True
    index = local / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(read_json_object(index)["weight_map"].values())
        except (DFlashError, KeyError, AttributeError, TypeError):
            return True  # (an index that is not one: loading names what is wrong with it)
        return all(isinstance(s, str) and (local / s).is_file() for s in shards)
    return any(f.is_file() for f in local.glob("*.safetensors"))


def _lacks(local: Path) -> str | None:
    """What the cached snapshot ``local`` lacks of a checkpoint, in a line that names it
    (``PATH has no config.json``; else :func:`~dflash_torch.checkpoint.weight_files`' words: a
    shard missing, a broken link, no safetensors weights, naming ``.bin`` ones); None where it
    holds what loading reads (:func:`_complete`).

    Raises:
        OSError: a part of it this process may not read."""
    from .checkpoint import weight_files

    if not (local / "config.json").is_file():
        return f"{local} has no config.json"
    if _complete(local):
        return None
    try:
        weight_files(local)
    except DFlashError as exc:
        return str(exc)
    return f"{local} has no safetensors weights"  # (not reached: weight_files names what _complete misses)


def _listed(repo: str, revision: str | None) -> set[str]:
    """The files of the repo's file list that huggingface_hub keeps (``trees/COMMIT.json``);
    empty where none is kept (or a huggingface_hub that keeps none: nothing to tell)."""
    try:
        from huggingface_hub import get_cached_repo_tree

        return {f.path for f in get_cached_repo_tree(repo, revision=revision)}
    except Exception:
        return set()


def _lacks_tokenizer(local: Path, files: set[str]) -> str | None:
    """Where the cached snapshot ``local`` lacks a tokenizer or vocabulary file (``tokenizer.json``,
    ``tokenizer_config.json``, ``merges.txt``, ...; a broken link is lacking) that ``files``, its
    repo's kept file list (:func:`_listed`), names: those, in a line naming ``local`` (a
    ``tokenizer_config.json`` alone is not a tokenizer); else None (a drafter's repo has none).

    Raises:
        OSError: a part of it this process may not read."""
    from .tokenizer import TOKENIZER_FILES, VOCABULARY_FILES

    missing = [f for f in dict.fromkeys((*TOKENIZER_FILES, *VOCABULARY_FILES)) if f in files and not (local / f).is_file()]
    return f"{local} lacks tokenizer files the repo has ({_named(local, missing)})" if missing else None


def _named(local: Path, names: list[str]) -> str:
    """``names``, files the snapshot ``local`` lacks, in words: each that is a link there (to a
    blob that is gone) is said to be a broken link."""
    return ", ".join(f + (" (a broken link)" if (local / f).is_symlink() else "") for f in names)


def download(name: str, cached: str | None = None) -> Path:
    """Download the Hugging Face Hub repo ``name`` (``ORG/NAME``, its ``main`` branch, or
    ``ORG/NAME@REVISION``, that branch, tag or commit hash) into the Hugging Face cache
    (``HF_HUB_CACHE``; huggingface_hub's progress bars on stderr; files already there are
    kept; a file whose download was interrupted is fetched again from its start, not resumed:
    huggingface_hub may leave its partial ``.incomplete`` file in the cache's ``blobs``) and
    return its snapshot directory. Only the files
    loading reads are fetched (:data:`HUB_FILES` at the repo's top level: safetensors
    weights, JSON configs, tokenizer and chat template files), never PyTorch ``.bin``
    weights or subfolders. A private or gated repo needs a token (``hf auth login`` or
    ``HF_TOKEN``). ``cached``: what an incomplete snapshot of it in the cache lacks, if there is
    one (:func:`_lacks`: ``PATH has no config.json``, a shard missing, ...; said when offline or
    the Hub cannot be reached).

    The download runs in a thread of its own, so that Ctrl-C stops the wait at once
    (``KeyboardInterrupt``; huggingface_hub's own threads finish the file they fetch unless
    the process exits: the command line exits without waiting for them, see
    :func:`downloading`).

    Raises:
        DFlashError: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE`` alone) is set (naming that variable and
            what ``cached`` lacks); the Hub cannot be reached
            (one that does not answer the repo's file list within ``HF_HUB_ETAG_TIMEOUT`` seconds, 10
            by default, too), or answers with an
            HTTP error; the repo does not exist or this user may not read it (private, gated);
            it has no such revision;
            it has no ``config.json``, or no safetensors weights (naming ``.bin`` ones); a file
            whose download timed out (no data for ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds, 10 by default,
            each of huggingface_hub's tries) or lost its connection after the Hub answered
            (naming the file and the partial snapshot: :func:`_stalled`); any
            other failure of the download (naming it), e.g. a full disk.
    """
    from huggingface_hub import HfApi, constants, snapshot_download

    repo, revision = split_revision(name)
    path = Path(name).absolute() if revision is None else None  # (what was looked for as a directory: a mistyped one?)
    if constants.HF_HUB_OFFLINE:
        where = (f"is in the Hugging Face cache incomplete ({cached})"
                 if cached else f"is not a local directory ({path}) and is not in the Hugging Face cache" if path
                 else f"is not a local directory and its revision {revision!r} is not in the Hugging Face cache")
        raise DFlashError(f"model {name!r} {where}; {offline_variable()} is set, so it is not downloaded")
    logging.getLogger("dflash_torch").warning(
        f"dflash-torch: downloading {name} from the Hugging Face Hub into {constants.HF_HUB_CACHE}")
    done: dict = {}
    finished = threading.Event()  # (not Thread.is_alive: a Ctrl-C in join() marks a running thread stopped)

    def fetch() -> None:
        try:  # (asked first, once: snapshot_download retries a Hub out of reach for ~25 s, for a commit hash; within
            # HF_HUB_ETAG_TIMEOUT seconds, as huggingface_hub asks for a file's metadata: a Hub that never answers hung)
            info = HfApi().model_info(repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
            done["files"] = [s.rfilename for s in info.siblings or () if "/" not in s.rfilename]
            done["commit"] = info.sha  # (the Hub answered: a failure from now on is a file's download)
            done["dir"] = snapshot_download(repo_id=repo, revision=revision, allow_patterns=HUB_FILES,
                                            ignore_patterns=HUB_SKIPPED)
        except BaseException as exc:  # (handed to the caller)
            done["error"] = exc
        finally:
            finished.set()

    _quiet_retries()
    _downloads.add(finished)
    threading.Thread(target=fetch, name=f"dflash-torch download {name}", daemon=True).start()
    while not finished.wait(0.1):  # (a Ctrl-C lands here, between waits)
        pass
    _downloads.discard(finished)
    if "error" in done:
        if not isinstance(done["error"], Exception):
            raise done["error"]
        stalled = _stalled(done["error"], repo, done.get("commit")) if "commit" in done else None
        raise DFlashError(f"cannot download model {name!r} from the Hugging Face Hub: "
                          f"{stalled or _reason(done['error'], revision, cached, path)}")
    return _downloaded(name, Path(done["dir"]), done["files"])


class _NoRetryLines(logging.Filter):
    """Drops huggingface_hub's lines on a file download it retries (``Error while downloading
    from URL: timed out`` / ``Trying to resume download...``, six times a file): the error that
    ends the download says it once (:func:`_stalled`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Error while downloading from")


def _quiet_retries() -> None:
    """Put :class:`_NoRetryLines` on huggingface_hub's download logger (once)."""
    logger = logging.getLogger("huggingface_hub.file_download")
    if not any(isinstance(f, _NoRetryLines) for f in logger.filters):
        logger.addFilter(_NoRetryLines())


def _stalled(exc: Exception, repo: str, commit: str | None) -> str | None:
    """Where ``exc`` is a timeout or lost connection of a file's download, after the Hub answered
    the repo's file list (so it was reached): which file, the ``HF_HUB_DOWNLOAD_TIMEOUT`` it
    waited for data, and the partial snapshot of ``commit`` the cache holds, in a line; else None."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    cause = (exc.__cause__ or exc.__context__) if isinstance(exc, LocalEntryNotFoundError) else exc
    if not _unreachable(cause):
        return None
    try:  # (httpx's error holds the request: its URL ends with the file, /ORG/NAME/resolve/COMMIT/FILE)
        file = str(cause.request.url.path).split("/resolve/", 1)[1].split("/", 1)[1]
    except Exception:
        file = "a file"
    timeout = any(c.__name__ in ("ReadTimeout", "TimeoutException", "Timeout") for c in type(cause).__mro__)
    what = (f"the download of {file} timed out (no data for HF_HUB_DOWNLOAD_TIMEOUT={constants.HF_HUB_DOWNLOAD_TIMEOUT} "
            "seconds, tried again by huggingface_hub)" if timeout
            else f"the download of {file} failed ({type(cause).__name__}: {first_line(cause)})")
    partial = _repo_folder(repo) / "snapshots" / commit if commit else None
    held = (f"; the Hugging Face cache holds its snapshot without it ({partial}): run again to fetch the rest"
            if partial is not None and partial.is_dir() else "")
    return (f"the Hub answered, but {what}{held}"
            + ("; on a slow link, set HF_HUB_DOWNLOAD_TIMEOUT to more seconds" if timeout else ""))


def _reason(exc: Exception, revision: str | None = None, cached: str | None = None, path: Path | None = None) -> str:
    """Why huggingface_hub's ``exc`` stopped a download of ``revision`` (None: ``main``), in a line;
    ``cached``: what an incomplete snapshot of it in the cache lacks, if there is one (said where the
    Hub cannot be reached: offline, nothing else could be used); ``path``: the directory the id
    would be as a path, if it could be one (said where the Hub has no such model or cannot be
    reached: a mistyped local path is taken for an id)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if isinstance(exc, RevisionNotFoundError):
        return f"it has no revision {revision or 'main'!r} (a branch, tag or commit hash)"
    if isinstance(exc, GatedRepoError):
        return "it is gated: accept its conditions on its Hub page, then log in (`hf auth login` or HF_TOKEN)"
    if isinstance(exc, RepositoryNotFoundError):
        return ("the Hub has no such model, or it is private and this user may not read it (log in: `hf auth login` or "
                "HF_TOKEN)" + (f", and it is not a local directory ({path})" if path else ""))
    cause = (exc.__cause__ or exc.__context__) if isinstance(exc, LocalEntryNotFoundError) else exc
    if isinstance(cause, HfHubHTTPError):  # (the Hub answered an error)
        return f"{constants.ENDPOINT} answered {first_line(cause)}"
    if isinstance(exc, LocalEntryNotFoundError) or _unreachable(cause):
        return ("the Hub cannot be reached" + (f" ({type(cause).__name__}: {first_line(cause)})" if cause else "")
                + (f", and the Hugging Face cache holds it incomplete ({cached})" if cached
                   else f", and it is not a local directory ({path}) and is not in the Hugging Face cache" if path
                   else ", and it is not in the Hugging Face cache" if revision is None
                   else f", and its revision {revision!r} is not in the Hugging Face cache"))
    return f"{type(exc).__name__}: {first_line(exc)}"  # (a full disk, ...: huggingface_hub's own message)


def _unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a connection error or a timeout of the HTTP client."""
    return exc is not None and any(c.__name__ in ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException",
                                                  "ConnectionError", "Timeout") for c in type(exc).__mro__)


def _downloaded(name: str, local: Path, files: list[str]) -> Path:
    """``local``, the snapshot just downloaded of ``name`` (``ORG/NAME[@REVISION]``), once it is seen
    to hold a checkpoint. Where it lacks one, ``files``, the repo's top-level files as the Hub
    listed them, tell what the repo lacks.

    Raises:
        DFlashError: no ``config.json``; no safetensors weights (naming the repo's ``.bin``
            weights, which are not downloaded); see :func:`~dflash_torch.checkpoint.weight_files`."""
    from .checkpoint import weight_files

    if _complete(local):
        weight_files(local)  # (a shard its index names that the repo lacks: named)
        return local
    if "config.json" not in files:
        raise DFlashError(f"model {name!r} on the Hugging Face Hub has no config.json: not a checkpoint in "
                          "Hugging Face format (config.json + safetensors)")
    if not any(f.endswith(".safetensors") for f in files):
        pickles = sorted(f for f in files if f.endswith(".bin"))
        hint = (f"; it holds {', '.join(pickles[:3])}{' ...' if len(pickles) > 3 else ''} (PyTorch pickle weights), "
                "which dflash-torch does not read: convert them to safetensors, e.g. load the model with "
                "transformers and save_pretrained(DIR, safe_serialization=True)") if pickles else ""
        raise DFlashError(f"model {name!r} on the Hugging Face Hub has no safetensors weights{hint}")
    weight_files(local)  # (what the snapshot lacks of them, named)
    return local


def cached_name(path: Path) -> str | None:
    """The Hub id (``ORG/NAME``) whose snapshot in the Hugging Face cache ``path`` is
    (``.../models--ORG--NAME/snapshots/COMMIT``), else None: said in errors that name the
    snapshot, a path that does not tell which model it is."""
    path = Path(path)
    return _folder_id(path.parent.parent.name) if path.parent.name == "snapshots" else None


def _folder_id(folder: str) -> str | None:
    """The Hub id (``ORG/NAME``) whose Hugging Face cache folder is named ``folder``
    (``models--ORG--NAME``, :func:`_repo_folder`'s; an id holds no ``--``), else None."""
    if folder.startswith("models--") and folder.count("--") == 2:
        return folder.removeprefix("models--").replace("--", "/")
    return None


def loaded_from(name: str | os.PathLike, path: Path) -> str:
    """``path``, the checkpoint directory that ``name`` (a model as given) was loaded from, as an
    error names it: absolute; a snapshot in the Hugging Face cache with its Hub id; a local
    directory whose ``name`` is also the id of a repo the cache holds (``./ORG/NAME``: a local
    directory comes before an id) with that said."""
    shown = Path(os.path.abspath(path))
    hub_id = cached_name(Path(os.path.realpath(path)))
    if hub_id is not None:
        return f"{shown} (the snapshot of {hub_id} in the Hugging Face cache)"
    repo = split_revision(str(name))[0]
    if repo.count("/") == 1 and not repo.startswith((".", "/", "~")):
        try:
            held = _repo_folder(repo).is_dir()
        except (OSError, ValueError):
            held = False
        if held:
            return (f"{shown} (a local directory, which comes before the Hugging Face id {repo} that the cache holds: "
                    f"run from another directory, or pass the cached snapshot's path, to load that)")
    return str(shown)


def offline_variable() -> str:
    """The environment variable that turns huggingface_hub's downloads off, as it reads them:
    ``HF_HUB_OFFLINE`` where that is set (to anything but empty: it alone decides), else
    ``TRANSFORMERS_OFFLINE`` where that is set; else ``HF_HUB_OFFLINE`` (set in Python, on
    ``huggingface_hub.constants``)."""
    if not os.environ.get("HF_HUB_OFFLINE") and os.environ.get("TRANSFORMERS_OFFLINE"):
        return "TRANSFORMERS_OFFLINE"
    return "HF_HUB_OFFLINE"


_HUB_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://www.huggingface.co/", "https://hf.co/",
                 "http://hf.co/", "huggingface.co/", "hf.co/", "hf://models/", "hf://")


def meant_id(name: str) -> str | None:
    """The Hub id (``ORG/NAME``, or ``ORG/NAME@REVISION``) that ``name``, a model that is
    neither a local directory nor an id, most likely means, else None: its Hub page's URL
    (``https://huggingface.co/ORG/NAME``, ``.../tree/REVISION``, ``hf.co/...``), an ``hf://``
    path, ``ORG/NAME/`` with a trailing slash, or the name of its Hugging Face cache folder
    (``models--ORG--NAME``, also at the end of a path)."""
    text, url = name.strip(), False
    for prefix in _HUB_PREFIXES:
        if text.lower().startswith(prefix):
            text, url = text[len(prefix):], True
            break
    else:
        folder_id = _folder_id(Path(text.rstrip("/")).name)
        if folder_id is not None:
            text = folder_id
        elif text.startswith(("/", ".", "~")):  # (a path: not an id)
            return None
    parts = [p for p in text.split("?")[0].split("#")[0].split("/") if p]
    if len(parts) < 2 or (not url and len(parts) > 2) or parts[0] in ("datasets", "spaces"):
        return None  # (a/b/c: a path; a dataset's or a Space's page: not a model)
    repo = f"{parts[0]}/{parts[1]}"
    revision = parts[3] if len(parts) >= 4 and parts[2] in ("tree", "blob", "resolve") else None
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        validate_repo_id(repo)
    except HFValidationError:
        return None
    meant = repo if revision is None else f"{repo}@{revision}"
    return None if meant == name else meant


def revision_of(model: str | os.PathLike) -> str | None:
    """The commit hash (40 hex digits, a ``str``) of the Hugging Face Hub snapshot that ``model``
    loads from, recorded beside the model's name (training_log.json, bench.json) since a branch
    such as ``main`` moves: for a directory that is a snapshot in the Hugging Face cache
    (``.../models--ORG--NAME/snapshots/COMMIT``, also through a link), its ``COMMIT``; for a Hub
    id that is not a local directory, ``ORG/NAME@COMMIT``'s ``COMMIT``, else the commit the
    cache's ``refs/REVISION`` (``refs/main`` without one) names, as loading read it; else None
    (a local directory of its own, or an id the cache does not hold). Reads only the local
    cache (no network); raises nothing (a part it may not read: None)."""
    try:
        path = Path(os.path.expanduser(str(model)))
        if path.is_dir():
            real = Path(os.path.realpath(path))
            return real.name if cached_name(real) is not None and _is_commit(real.name) else None
        repo, revision = split_revision(str(model))
        if revision is not None and _is_commit(revision):
            return revision
        from huggingface_hub import constants

        ref = Path(constants.HF_HUB_CACHE) / ("models--" + repo.replace("/", "--")) / "refs" / (revision or "main")
        commit = ref.read_text().strip()
        return commit if _is_commit(commit) else None
    except (OSError, ValueError):
        return None


def _is_commit(text: str) -> bool:
    """Whether ``text`` is a full git commit hash (40 lowercase hex digits)."""
    return len(text) == 40 and all(c in "0123456789abcdef" for c in text)


def downloading() -> bool:
    """Whether a download that a Ctrl-C stopped waiting for still runs (its threads would hold
    up the interpreter's exit until it ends)."""
    return any(not finished.is_set() for finished in _downloads)


def _unreadable_cache_entry(name: str, revision: str | None = None) -> Path | None:
    """The part of the Hugging Face cache entry of the repo ``name`` (``ORG/NAME``; its folder,
    ``refs``, ``refs/REVISION``, ``refs/main`` without one, ``snapshots``) that this process may
    not read, else None: huggingface_hub then says only that the repo is not cached."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    repo = root / ("models--" + name.replace("/", "--"))
    ref = repo / "refs" / (revision or "main")  # (a commit hash has none: not there, passed over)
    for part in (root, repo, repo / "refs", ref, repo / "snapshots"):
        try:
            if part == ref:
                part.open("rb").close()
            else:
                os.listdir(part)
        except PermissionError:
            return part
        except OSError:
            continue
    return None
