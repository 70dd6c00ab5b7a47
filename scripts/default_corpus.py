"""Corpus definition for the shipped default target model (and its drafter).

The corpus is the running interpreter's standard library ``.py`` sources.
Test directories and ``site-packages`` are excluded.  A fixed list of
held-out modules (``dflash_torch/assets/default/heldout_modules.txt``) is
kept out of the training split and used for evaluation only.

Usage from another script in ``scripts/``::

    from default_corpus import corpus_files
    train = corpus_files("train")
    heldout = corpus_files("heldout")

Both splits are sorted (by path relative to the stdlib dir) and deterministic
for a given interpreter installation.
"""

from __future__ import annotations

import pathlib
import sysconfig
from typing import Iterable, Literal

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
HELDOUT_LIST = REPO_ROOT / "dflash_torch" / "assets" / "default" / "heldout_modules.txt"

# Directory names that are never part of the corpus (anywhere in the path).
EXCLUDED_DIR_NAMES = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def recorded_path(path: pathlib.Path | str) -> str:
    """``path`` as a shipped ``training_log.json`` records it: relative to the repository
    where it lies in it (``dflash_torch/assets/default/target``), under the interpreter's
    ``<sys.prefix>`` (or a venv's ``<sys.base_prefix>``) where it lies there (the stdlib),
    else as given: the build machine's absolute paths (``/work/main/...``,
    ``/root/.pyenv/...``) mean nothing on another."""
    import sys

    resolved = pathlib.Path(path).expanduser().resolve()
    for root, name in ((REPO_ROOT, None), (pathlib.Path(sys.prefix).resolve(), "<sys.prefix>"),
                       (pathlib.Path(sys.base_prefix).resolve(), "<sys.base_prefix>")):  # (a venv's stdlib)
        if resolved.is_relative_to(root):
            rel = resolved.relative_to(root).as_posix()
            return rel if name is None else f"{name}/{rel}"
    return str(path)


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()


def load_heldout(path: pathlib.Path | str = HELDOUT_LIST) -> list[str]:
    names = []
    for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def is_heldout(rel: pathlib.PurePath, heldout: Iterable[str]) -> bool:
    """Packages match by top-level directory name, modules by top-level file stem."""
    names = set(heldout)
    parts = rel.parts
    if len(parts) > 1:
        return parts[0] in names
    return rel.stem in names


def _all_files(root: pathlib.Path) -> list[pathlib.Path]:
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIR_NAMES for part in rel.parts[:-1]):
            continue
        if not p.is_file():
            continue
        out.append(p)
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    return out


def corpus_files(
    split: Literal["train", "heldout"],
    root: pathlib.Path | str | None = None,
    heldout: Iterable[str] | None = None,
) -> list[pathlib.Path]:
    """Sorted, deterministic list of corpus files for ``split``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_dir() if root is None else pathlib.Path(root).resolve()
    held = load_heldout() if heldout is None else list(heldout)
    want_heldout = split == "heldout"
    return [p for p in _all_files(root) if is_heldout(p.relative_to(root), held) == want_heldout]


def module_name(path: pathlib.Path, root: pathlib.Path | str | None = None) -> str:
    """Dotted module name of a corpus file (``json/decoder.py`` -> ``json.decoder``)."""
    root = stdlib_dir() if root is None else pathlib.Path(root).resolve()
    rel = pathlib.Path(path).resolve().relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def read_source(path: pathlib.Path) -> str | None:
    """File text (UTF-8), or None when the file is not valid UTF-8."""
    try:
        return pathlib.Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


if __name__ == "__main__":
    for split in ("train", "heldout"):
        files = corpus_files(split)
        size = sum(p.stat().st_size for p in files)
        print(f"{split}: {len(files)} files, {size / 1e6:.2f} MB")
