"""What the batching scripts (``prefill_stalls.py``, ``shared_prefill.py``,
``prefix_reuse.py``) share: their common options, loading the pair, the shipped prompts as
one token stream, and the JSON dump. Importing it puts the repository on ``sys.path``."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dflash_torch import DFlashEngine  # noqa: E402
from dflash_torch.cli import check_counts, check_out_file, write_out_file  # noqa: E402
from dflash_torch.options import check_threads  # noqa: E402
from dflash_torch.bench.modes import load_prompts  # noqa: E402
from dflash_torch.engine import ASSETS  # noqa: E402


def add_common_args(ap: argparse.ArgumentParser, pair: bool = False) -> None:
    """``--dtype --threads --reps --json`` (and ``--target --drafter`` with ``pair``)."""
    if pair:
        ap.add_argument("--target", default=None, help="target checkpoint (default: the shipped one)")
        ap.add_argument("--drafter", default=None, help="drafter checkpoint (default: the shipped one)")
        ap.flags["draft"] = "--drafter"  # (the engine's errors name its parameter, draft: named as this flag)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")


def load_engine(args: argparse.Namespace) -> DFlashEngine:
    """Check the common options (``--threads`` at most the CPUs this process may use,
    ``--reps`` >= 1, ``--json`` a file that can be written; ``--dtype`` as the engine checks
    it), set ``--threads`` and load the pair (the shipped one unless ``--target/--drafter``).

    Raises:
        DFlashError: an option's value, or a checkpoint that cannot be loaded.
    """
    check_counts(args, "reps")
    check_out_file(args.json, "--json")
    if args.threads is not None:
        torch.set_num_threads(check_threads(args.threads, "--threads"))
    return DFlashEngine.from_pretrained(getattr(args, "target", None), getattr(args, "drafter", None),
                                        dtype=args.dtype)


def shipped_prompts(engine: DFlashEngine) -> list[list[int]]:
    """The shipped ``prompts.jsonl``, each prompt encoded."""
    return [engine.encode_prompt(p) for p in load_prompts(ASSETS / "prompts.jsonl", None)]


def shipped_tokens(engine: DFlashEngine, n: int | None = None) -> list[int]:
    """The shipped prompts' tokens concatenated (repeated, then cut to ``n`` tokens when
    ``n`` is given)."""
    ids = [t for p in shipped_prompts(engine) for t in p]
    if n is None:
        return ids
    while len(ids) < n:
        ids += ids
    return ids[:n]


def write_json(args: argparse.Namespace, results: dict) -> None:
    """Write ``{"args": ..., **results}`` to ``--json``, if given.

    Raises:
        DFlashError: it cannot be written."""
    if args.json:
        kept = {k: v for k, v in vars(args).items() if k != "option_flags"}  # (the parser's, not an option)
        write_out_file(args.json, json.dumps({"args": kept, **results}, indent=1))
