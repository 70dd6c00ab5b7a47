"""The drafter training loop: AdamW, linear warm-up then cosine decay, gradient
clipping, bf16 autocast, resumable checkpoints, a held-out acceptance estimate,
and export in the published DFlash (or DFlash 2) checkpoint format.

The target is frozen (its embedding and LM head are shared with the drafter, which
has none of its own); its features are computed on the fly without gradients.
Everything random in a step (batch rows, anchors) comes from a generator seeded by
``(seed, step)``, so a resumed run continues exactly as an uninterrupted one would
(with ``--steps`` alone; a wall-clock budget makes the schedule depend on time).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError

from ..chat_template import reserved_template_variables
from .. import checkpoint, hub
from ..checkpoint import all_finite, checkpoint_dir, load_config, memory_text
from ..cli import deferred_interrupt, interrupt_signals, missing_dirs
from ..errors import DFlashError, OptionError, named, quoted
from ..models.config import TargetConfig
from ..models.drafter_config import (DFlash2Settings, DrafterConfig, default_target_layer_ids, fill_mask_token_id,
                                     needs_mask_token_id, token_ids, unused_token_id, validate_pair)
from ..models.drafter import DFlashDrafter, drafter_class
from ..models.target import TargetModel
from ..options import check_chat_template_kwargs, context_limit
from ..tokenizer import load_tokenizer
from .data import (
    Corpus, Example, MaskAsText, TrainingData, collate, corpus_files, mask_as_text, read_corpus, step_generator,
    tokenize_conversation, tokenize_documents,
)
from .objective import batch_loss, copy_target_layers, default_gamma, greedy_walk, init_drafter_weights, sample_anchors
from .runlock import RunLock

MASK_TOKEN = "<|MASK|>"
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_KEYS = ("drafter", "optimizer", "step", "elapsed", "history", "evals", "drafter_config")
"""The keys every training checkpoint holds (what ``--resume`` reads)."""
ARCHS = ("dflash", "dflash2")
VAL_TAU_NOTE_FIELDS = ("seq_len", "self_distill", "block_size")
"""The fields a ``val_tau_note`` names (:meth:`Trainer.evaluate`): the command line says their flags."""
PROGRESS_LINE_EVERY_S = 30.0
"""Seconds between the progress lines said where no progress bar is drawn (stderr not a terminal)."""


# the TrainConfig fields that shape a run's trajectory (a --resume with other values warns; not
# --steps / --time-budget-min: resuming to train longer is what they are for)
RECIPE = ("data", "batch", "seq_len", "anchors_per_seq", "lr", "min_lr_frac", "warmup_steps",
          "weight_decay", "grad_clip", "gamma", "seed", "self_distill", "self_distill_batch", "prefix_min", "prefix_max",
          "raw_fraction", "val_seqs", "autocast", "selector_loss_weight", "chat_template_kwargs")


@dataclass
class TrainConfig:
    """Every setting of a training run. ``dflash-torch train``'s flags set them, a flag a
    field (``gamma`` is ``--gamma``, ``num_threads`` ``--threads``, ``autocast=False``
    ``--no-autocast``, ``progress=False`` ``--no-progress``: no progress bars; with True, they
    are drawn on stderr where that is a terminal), but for ``min_lr_frac`` and
    ``log_every``, which have no flag. ``data`` is a list of paths; one path (a ``str`` or
    ``os.PathLike``) is taken as a list of it, and paths given as ``os.PathLike`` are kept as
    ``str`` (as the checkpoint and ``training_log.json`` record them); ``save_dtype`` given as
    a ``torch.dtype`` is kept as its name (``torch.bfloat16`` -> ``"bfloat16"``). The values are
    checked by :func:`check_config`, and the directories by :func:`check_run_dirs`, when
    :meth:`Trainer.run` starts, before the target loads.

    ``overwrite`` (``--overwrite``) lets a run replace a drafter already in ``out`` and a
    checkpoint in the work dir (``work_dir``, default ``out/train_work``), which are refused
    otherwise (``resume`` continues that checkpoint instead). With ``init_from``, the drafter's
    shape is that drafter's: ``num_layers``, ``block_size`` (and for a DFlash 2 source its
    convolution and selector sizes) are taken from it, and one set to another value than its
    default and the source's is refused."""

    target: str
    data: list[str]
    out: str
    work_dir: str | None = None
    arch: str = "dflash"
    num_layers: int = 2
    init_from_target: bool = False
    init_from: str | None = None
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    steps: int | None = None
    time_budget_min: float | None = None
    batch: int = 8
    seq_len: int = 512
    anchors_per_seq: int = 64
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    seed: int = 0
    resume: bool = False
    overwrite: bool = False
    self_distill: int = 0
    self_distill_batch: int = 32
    prefix_min: int = 32
    prefix_max: int = 256
    raw_fraction: float = 0.25
    val_seqs: int = 32
    eval_every: int = 100
    ckpt_every: int = 200
    log_every: int = 10
    num_threads: int | None = None
    autocast: bool = True
    save_dtype: str = "bfloat16"
    progress: bool = True
    selector_loss_weight: float = 1.0
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    chat_template_kwargs: dict | None = None  # extra chat template variables for the chat data and self-distill prompts

    def __post_init__(self):
        if isinstance(self.data, (str, os.PathLike)):  # (a str was read as a list of one-letter paths: trial)
            self.data = [self.data]
        if isinstance(self.data, (list, tuple)):
            self.data = [os.fspath(p) if isinstance(p, os.PathLike) else p for p in self.data]
        for key in ("target", "out", "work_dir", "init_from"):  # (a Path failed the export's json.dumps after training)
            if isinstance(getattr(self, key), os.PathLike):
                setattr(self, key, os.fspath(getattr(self, key)))
        if isinstance(self.save_dtype, torch.dtype):  # (it failed the export's json.dumps after training: trial-259)
            self.save_dtype = str(self.save_dtype).removeprefix("torch.")

    def work_path(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(self.out) / "train_work"

    def own_dirs(self) -> list[Path]:
        """The directories this run writes (``--out``, the work dir): left out of a ``--data``
        directory that holds them, lest a later run train on the drafter's own files."""
        return [Path(self.out), self.work_path()]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# the fields only a DFlash 2 drafter uses (--arch dflash2)
DFLASH2_FIELDS = ("selector_loss_weight", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
BOOL_FIELDS = ("init_from_target", "resume", "overwrite", "autocast", "progress")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds ``torch.manual_seed`` takes (inclusive)."""


def given_fields(cfg: TrainConfig) -> set[str]:
    """The fields of ``cfg`` set to another value than their defaults: those taken as given
    where it is not known which were (:func:`check_config` of a Python :class:`TrainConfig`)."""
    return {f.name for f in fields(cfg) if f.default is not MISSING and getattr(cfg, f.name) != f.default}


def _check_types(cfg: TrainConfig) -> None:
    """The type checks of :func:`check_config` (its counts and numbers check their own)."""
    from ..errors import shown

    for key in ("target", "out", "work_dir", "init_from"):  # (None, 123: a TypeError of posixpath after a while)
        value = getattr(cfg, key)
        if not (isinstance(value, str) or (value is None and key in ("work_dir", "init_from"))):
            what = "a directory" if key in ("out", "work_dir") else "a checkpoint directory or Hugging Face id"
            raise OptionError(f"{key} must be {what} (a str or os.PathLike){' or None' if key in ('work_dir', 'init_from') else ''}, "
                              f"got {shown(value)}", key)
    for key in BOOL_FIELDS:  # ("no" was true: autocast="no" trained with autocast on)
        value = getattr(cfg, key)
        if not isinstance(value, bool):
            raise OptionError(f"{key} must be True or False, got {shown(value)}", key)
    # (1.0 and True were taken, and written into a config.json the engine refuses; "1,3" was a TypeError)
    ids = cfg.target_layer_ids
    if ids is not None and not (isinstance(ids, (list, tuple)) and all(_is_int(i) for i in ids)):
        raise OptionError(f"target_layer_ids must be a list of integers (target layer ids), got {shown(ids)}",
                          "target_layer_ids")
    if cfg.mask_token_id is not None and not _is_int(cfg.mask_token_id):
        raise OptionError(f"mask_token_id must be an integer (a token id), got {shown(cfg.mask_token_id)}",
                          "mask_token_id")
    lo, hi = SEED_RANGE  # (a ValueError of random.seed, or torch's "Overflow when unpacking long long", after the target loaded)
    if not (_is_int(cfg.seed) and lo <= cfg.seed <= hi):
        raise OptionError(f"seed must be an integer from -2**63 to 2**64 - 1 (what torch.manual_seed takes), "
                          f"got {shown(cfg.seed)}", "seed")
    if not isinstance(cfg.save_dtype, (str, torch.dtype)):
        raise OptionError(f"save_dtype must be a dtype name ('bfloat16', 'float32') or a torch.dtype, got "
                          f"{shown(cfg.save_dtype)}", "save_dtype")


def check_config(cfg: TrainConfig, given: set[str] | None = None) -> None:
    """Refuse settings of ``cfg`` that cannot train anything, before anything is read or
    loaded: the checks ``dflash-torch train`` makes of its flags and :meth:`Trainer.run` of a
    :class:`TrainConfig` alike (the Python API skipped them: ``gamma=0.0`` trained with the
    default gamma, ``steps=0`` exported an untrained drafter, ``batch=0`` was an
    AttributeError). Messages name the field (``gamma must be a finite number > 0, got
    0.0``), which the command line shows as its flag (``--gamma``).

    ``given``: the fields the user set (the command line's flags given); by default those
    that differ from their defaults (:func:`given_fields`). A given DFlash 2 field
    (:data:`DFLASH2_FIELDS`) is refused without ``arch="dflash2"``, a given ``prefix_min`` or
    ``prefix_max`` longer than ``seq_len - 16`` with ``self_distill`` (a default one is cut to
    that), and with ``init_from`` a ``num_layers`` or ``block_size`` in ``given`` (the command
    line's; a Python one is refused where it differs from the source's: :func:`load_init_drafter`).

    Types: the paths (``target``, ``out``, and ``work_dir`` and ``init_from`` where given) must
    be ``str`` (or ``os.PathLike``, kept as ``str``), the bool fields (:data:`BOOL_FIELDS`)
    ``bool``, ``target_layer_ids`` a list of ``int`` and ``mask_token_id`` an ``int`` where
    given, ``seed`` an ``int`` in :data:`SEED_RANGE`, ``save_dtype`` a name or ``torch.dtype``.
    Counts (``batch``, ``seq_len``, ``anchors_per_seq``, ``num_layers``, ``eval_every``,
    ``ckpt_every``, ``log_every``, ``self_distill_batch``, ``prefix_min``, ``prefix_max``,
    ``steps`` and ``intermediate_size`` where given, the DFlash 2 sizes) must be integers
    >= 1, ``block_size`` one >= 2; ``warmup_steps``, ``val_seqs`` and ``self_distill``
    integers >= 0; ``lr``, ``grad_clip``, and ``gamma`` and ``time_budget_min`` where given
    finite numbers > 0; ``weight_decay`` and ``selector_loss_weight`` finite numbers >= 0;
    ``raw_fraction`` and ``min_lr_frac`` in [0, 1]. (Ints, not bools, and ints or floats where
    numbers are asked for.)

    Raises:
        OptionError: the first setting that fails, naming it (and the others it is weighed
            against: ``prefix_min (10) must be <= prefix_max (5)``): also no ``steps`` nor
            ``time_budget_min``, no ``data`` path, an unknown ``arch`` or ``save_dtype``,
            ``num_threads`` beyond the CPUs this process may use, ``resume`` with ``overwrite``,
            ``init_from`` with a shape setting or ``init_from_target``, or without
            ``init_from`` a ``seq_len`` not longer than ``block_size``.
    """
    from ..errors import shown
    from ..options import check_choice, check_threads, resolve_save_dtype

    data = cfg.data
    if not isinstance(data, (list, tuple)) or not all(isinstance(p, str) for p in data):
        raise OptionError(f"data must be a path or a list of paths (text or data files, directories), got "
                          f"{shown(data)}", "data")
    if not data:
        raise OptionError("data must name at least one path (a text or data file, a directory)", "data")
    _check_types(cfg)
    told = given is not None  # (the command line's: the flags given)
    given = given_fields(cfg) if given is None else given
    check_choice(cfg.arch, ARCHS, "arch")
    if cfg.arch != "dflash2":  # (they were silently ignored)
        for key in DFLASH2_FIELDS:
            if key in given:
                raise OptionError(f"{key} is an option of DFlash 2 drafters (arch dflash2); this run trains a "
                                  f"{cfg.arch} drafter", key, "arch")
    if cfg.init_from is not None:  # (the drafter's shape and weights come from it)
        shape = [k for k in ("num_layers", "block_size") if told and k in given]  # (Python: load_init_drafter's)
        for key in shape + [k for k in ("init_from_target", "target_layer_ids", "intermediate_size", "mask_token_id")
                            if getattr(cfg, k) not in (None, False)]:
            raise OptionError(f"{key} cannot be combined with init_from (the drafter's shape and weights come "
                              "from it)", key, "init_from")
    counts = ["batch", "seq_len", "anchors_per_seq", "num_layers", "eval_every", "ckpt_every",
              "log_every", "self_distill_batch", "prefix_min", "prefix_max"]
    counts += [k for k in ("steps", "intermediate_size") if getattr(cfg, k) is not None]  # (0 read as "not given")
    if cfg.arch == "dflash2":
        counts += ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"]
    for key in counts:
        value = getattr(cfg, key)
        if not _is_int(value):
            raise OptionError(f"{key} must be an integer >= 1, got {shown(value)}", key)
        if value < 1:
            raise OptionError(f"{key} must be >= 1, got {value}", key)
    if not _is_int(cfg.block_size):  # (with init_from unused, as the other shape settings)
        raise OptionError(f"block_size must be an integer >= 2, got {shown(cfg.block_size)}", "block_size")
    if cfg.block_size < 2:
        raise OptionError(f"block_size must be >= 2, got {cfg.block_size}", "block_size")
    for key in ("warmup_steps", "val_seqs", "self_distill"):
        value = getattr(cfg, key)
        if not (_is_int(value) and value >= 0):
            raise OptionError(f"{key} must be an integer >= 0, got {shown(value)}", key)
    if cfg.num_threads is not None:
        check_threads(cfg.num_threads, "num_threads")
    # (inf and NaN passed: an lr of inf saved a drafter of NaN weights; a gamma of NaN failed as a divergence that
    # blamed the lr, and one of 0 trained with the default)
    for key in ("lr", "time_budget_min", "gamma", "grad_clip"):
        value = getattr(cfg, key)
        if value is not None and not (_is_number(value) and value > 0 and math.isfinite(value)):
            raise OptionError(f"{key} must be a finite number > 0, got {shown(value)}", key)
    for key in ("weight_decay", "selector_loss_weight"):
        value = getattr(cfg, key)
        if not (_is_number(value) and value >= 0 and math.isfinite(value)):
            raise OptionError(f"{key} must be a finite number >= 0, got {shown(value)}", key)
    for key in ("raw_fraction", "min_lr_frac"):
        value = getattr(cfg, key)
        if not (_is_number(value) and 0 <= value <= 1):
            raise OptionError(f"{key} must be in [0, 1], got {shown(value)}", key)
    if cfg.prefix_min > cfg.prefix_max:
        raise OptionError(f"prefix_min ({cfg.prefix_min}) must be <= prefix_max ({cfg.prefix_max})",
                          "prefix_min", "prefix_max")
    room = cfg.seq_len - 16  # (a self-distill prompt leaves 16 tokens of seq_len at least to the continuation)
    for key in ("prefix_min", "prefix_max"):
        value = getattr(cfg, key)
        if cfg.self_distill and key in given and value > room:  # (given: it was cut to that, unsaid)
            raise named(f"{key} {value} is longer than a self-distill prompt may be at seq_len {cfg.seq_len} "
                        f"({room} tokens, leaving 16 to the continuation): give at most {room}, or a longer seq_len",
                        key, "seq_len")
    if cfg.init_from is None and cfg.seq_len <= cfg.block_size:
        raise OptionError(f"seq_len ({cfg.seq_len}) must be longer than the block size ({cfg.block_size})", "seq_len")
    resolve_save_dtype(cfg.save_dtype)
    if cfg.resume and cfg.overwrite:  # (it resumed, unsaid)
        raise OptionError("resume=True continues the checkpoint in the work dir and overwrite=True starts over: give "
                          "one of them", "resume", "overwrite")
    if cfg.steps is None and cfg.time_budget_min is None:  # (last: a value given wrong is said first)
        raise OptionError("give steps, time_budget_min, or both", "steps", "time_budget_min")


def check_run_dirs(cfg: TrainConfig, resolved: dict | None = None) -> None:
    """Refuse, in one line, directories a run of ``cfg`` (checked by :func:`check_config`)
    must not write, then make ``out`` and the work dir (:meth:`TrainConfig.work_path`) and
    check that this process may write there: before the target loads. :meth:`Trainer.run`
    does this for the command line and the Python API alike (the Python API skipped it:
    ``out`` the target's directory replaced the target's weights; trial-259). Messages name
    the fields (``out ... is the target's directory``), which the command line shows as flags.

    Raises:
        OptionError: ``out`` or ``work_dir`` an existing file, a directory this process may
            not list or write, or the directory of ``target`` (or, for a Hugging Face id, its
            cache folder), of a cached ``init_from``, or inside one; a ``data`` path that is
            ``out`` or the work dir; without ``resume`` or ``overwrite``, a work dir that
            holds a ``checkpoint.pt`` or an ``out`` that holds a ``config.json`` or weight files.

    ``resolved``, where given, is filled with the directory of each model it resolves (``target``,
    a cached ``init_from``: :func:`~dflash_torch.checkpoint.resolve_model_dir`) by field name, or
    the ``DFlashError`` resolving it raised (not raised here: the load says it, in its turn), for
    the load to take (:meth:`Trainer.run`): a Hub id is resolved, and fetched, once.
    """
    out, work = Path(cfg.out), cfg.work_path()
    for key, path, given in (("out", out, True), ("work_dir", work, cfg.work_dir is not None)):
        try:  # (one it may not list or enter was a PermissionError traceback from looking into it below)
            if path.is_dir():
                os.listdir(path)
            elif given and path.exists():  # (a NotADirectoryError once the target had loaded)
                raise OptionError(f"{key} {quoted(path)} is a file; give a directory", key)
        except OSError as exc:
            raise OptionError(f"cannot use {key} {quoted(path)} as a directory: {exc.strerror or exc}", key) from None
    # (a cached id's snapshot too: the drafter was written through its links into the blobs; the work dir's
    # checkpoint.pt and data caches were written into the target's directory, or a directory in it)
    mine = {"out": (cfg.out, out), "work_dir": (cfg.work_dir or str(work), work)}
    cached_init = cfg.init_from is not None and not Path(cfg.init_from).is_dir()
    for field, whose, name, names in (
            ("target", "the target's directory", cfg.target, ()),
            ("init_from", f"the directory of init_from {quoted(cfg.init_from)} in the Hugging Face cache",
             cfg.init_from if cached_init else None, ("init_from",))):
        try:
            found = None if name is None else checkpoint.resolve_model_dir(name)
        except DFlashError as exc:  # (said where it loads, which takes it: it tried, and said "downloading", again)
            found = exc
        if name is not None and resolved is not None:
            resolved[field] = found
        source = os.path.realpath(found) if isinstance(found, Path) else None
        # (a cached id's whole cache folder, models--ORG--NAME: its blobs, and what deleting the model deletes)
        folder = Path(source).parents[1] if source is not None and Path(source).parent.name == "snapshots" and \
            Path(source).parents[1].name.startswith("models--") else None
        for key, (shown, path) in mine.items():
            real = os.path.realpath(path)  # (where mkdir makes it: a path not there yet too)
            own = "the drafter its own directory" if key == "out" else \
                "the data cache and checkpoint a directory of their own"
            if source is not None and (real == source or real.startswith(os.path.join(source, ""))):
                if real == source:
                    raise OptionError(f"{key} {quoted(shown)} is {whose}; give {own}", key, *names)
                raise OptionError(f"{key} {quoted(shown)} is inside {whose}; give {own} outside it", key, *names)
            if folder is not None and (real == str(folder) or real.startswith(os.path.join(folder, ""))):
                raise OptionError(f"{key} {quoted(shown)} is inside the Hugging Face cache folder of {quoted(name)} ({quoted(folder)}); "
                                  f"give {own} outside it", key)
    own = {os.path.realpath(work): "work_dir", os.path.realpath(out): "out"}
    for given in cfg.data:  # (one below them is read without them: read_corpus leaves them out)
        if os.path.realpath(given) in own:  # (it trained on the drafter's config.json and log, then replaced them)
            raise OptionError(f"data {quoted(given)} is this run's {own[os.path.realpath(given)]}: the drafter's own files "
                              "would be read as data; put the data in a directory of its own",
                              "data", own[os.path.realpath(given)])
    if not (cfg.overwrite or cfg.resume):  # (the Python API replaced them, unsaid: trial-259)
        if foreign_checkpoint(work / CHECKPOINT):  # (another tool's: not "a training checkpoint" to resume)
            raise OptionError(f"{quoted(work / CHECKPOINT)} is not a dflash-torch training checkpoint: give another "
                              "work_dir, or pass overwrite=True to replace it", "work_dir", "overwrite")
        if (work / CHECKPOINT).exists():
            raise OptionError(f"{quoted(work)} holds a training checkpoint: pass resume=True to continue it or overwrite=True "
                              "to start over", "resume", "overwrite")
        found = sorted(f.name for f in out.iterdir() if f.name == "config.json" or STALE_WEIGHTS.fullmatch(f.name)) \
            if out.is_dir() else []
        if found:  # (it said "a checkpoint", as the work dir's checkpoint.pt to resume: trial-175)
            raise OptionError(f"out {quoted(cfg.out)} already holds a drafter or other model ({', '.join(found[:3])}"
                              f"{', ...' if len(found) > 3 else ''}): pass overwrite=True to replace it", "out", "overwrite")
    for key, path in (("out", out), ("work_dir", work)):
        try:  # (made before the target loads: it failed with a traceback after; so did one it may not write)
            path.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
        except OSError as exc:
            raise OptionError(f"cannot use {key} {quoted(path)} as a directory: {exc.strerror or exc}", key) from None


def resolve_mask_token_id(tokenizer, vocab_size: int, override: int | None) -> tuple[int, str]:
    """The block mask token id and how it was chosen.

    Order: ``override``; the tokenizer's ``mask_token_id``; a ``<|MASK|>`` token in its
    vocabulary; else the first embedding row below ``vocab_size`` that is no token id of the
    tokenizer's vocabulary (:func:`~dflash_torch.models.drafter_config.unused_token_id`: no
    text maps to it; ``len(tokenizer)`` where the vocabulary's ids have no gaps, as the
    engine gives a drafter config without a mask token id, else the first gap).

    Raises:
        OptionError: ``override`` outside the vocabulary, or none of these exists (pass
            ``mask_token_id`` with an unused id), naming ``mask_token_id``.
    """
    if override is not None:
        if not 0 <= override < vocab_size:
            raise OptionError(f"mask_token_id {override} is outside the target vocabulary of {vocab_size}",
                              "mask_token_id")
        return override, "given"
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= mid < vocab_size:
        return int(mid), "tokenizer mask token"
    mid = tokenizer.convert_tokens_to_ids(MASK_TOKEN) if MASK_TOKEN in tokenizer.get_vocab() else None
    if mid is not None and 0 <= mid < vocab_size:
        return int(mid), f"tokenizer token {MASK_TOKEN}"
    free = unused_token_id(tokenizer, vocab_size)  # (not len(tokenizer): a vocabulary with gaps has a token there)
    if free is not None:
        return free, "the first embedding row that is no token of the tokenizer"
    raise OptionError("the target tokenizer has no mask token and no unused embedding row; "
                      "pass mask_token_id with a token id the data never uses", "mask_token_id")


def dflash2_settings(cfg: TrainConfig, hidden_size: int, vocab_size: int) -> DFlash2Settings | None:
    """The DFlash 2 modules of ``--arch dflash2`` (None for ``dflash``).

    Raises:
        OptionError: an unknown arch, or convolution / selector sizes that do not fit, naming the field.
    """
    if cfg.arch not in ARCHS:
        raise OptionError(f"arch must be one of {', '.join(ARCHS)}, got {cfg.arch!r}", "arch")
    if cfg.arch == "dflash":
        return None
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if getattr(cfg, key) < 1:
            raise OptionError(f"{key} must be >= 1, got {getattr(cfg, key)}", key)
    if hidden_size % cfg.conv_group_size:
        raise OptionError(f"conv_group_size {cfg.conv_group_size} does not divide the hidden size {hidden_size}",
                          "conv_group_size")
    if cfg.selector_top_k > vocab_size:
        raise OptionError(f"selector_top_k {cfg.selector_top_k} exceeds the vocabulary of {vocab_size}",
                          "selector_top_k")
    return DFlash2Settings(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                           selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)


def _ids_text(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def _usable(ids: list[int], L: int) -> bool:
    """Target layer ids inside ``L`` layers, each read once, in increasing order."""
    return all(0 <= i < L for i in ids) and all(a < b for a, b in zip(ids, ids[1:]))


def _ids_said(ids: list[int], most: int = 12) -> str:
    """``ids`` as a message shows them: the list, or for more than ``most`` its first and last
    ids around the count left out (``[1, 1, 1, ... (99,990 more) ..., 1, 1]``)."""
    if len(ids) <= most:
        return str(ids)
    half = most // 2
    return f"[{', '.join(map(str, ids[:half]))}, ... ({len(ids) - 2 * half:,} more) ..., {', '.join(map(str, ids[-half:]))}]"


def default_layer_ids(L: int, n: int) -> tuple[list[int], str | None]:
    """The ``target_layer_ids`` of an ``n``-layer drafter trained for an ``L``-layer target
    without ``target_layer_ids``: the DFlash reference rule (:func:`default_target_layer_ids`),
    and a warning line where it repeats a layer or reads them out of order (below 4 target
    layers, or more drafter layers than layers 1 .. L - 3), naming the fields
    ``target_layer_ids`` and ``num_layers`` (:meth:`Trainer.say` names them as flags on the
    command line).

    Raises:
        OptionError: the rule names layers outside the target's (below 3 target layers),
            with a ``num_layers`` whose ids fit, if any, and ``target_layer_ids``.
    """
    ids = default_target_layer_ids(L, n)
    if _usable(ids, L):
        return ids, None
    rule = f"the DFlash rule spreads them from layer 1 to layer L - 3 = {L - 3}"
    # the most drafter layers whose ids the rule picks usable (1 at least: it reads layer L // 2): the rule's m ids
    # from 1 to L - 3 are distinct and increasing exactly when m - 1 <= L - 4 (steps of at least one layer), which
    # needs L >= 4; computed, not searched (trying each m below n was quadratic: --num-layers 100000 hung, trial-293)
    fewer = next((m for m in range(min(n - 1, max(L - 3, 1)), 0, -1) if _usable(default_target_layer_ids(L, m), L)),
                 None)
    example = _ids_text([i * (L - 1) // (n - 1) for i in range(n)]) if 1 < n <= L else None
    choose = f"choose {n} layers with target_layer_ids" + (f" (e.g. {example})" if example else "")
    if any(not 0 <= i < L for i in ids):
        raise named(f"the default target layers of a {n}-layer drafter are {_ids_said(ids)} ({rule}), outside the target's "
                    f"{L} layer{'s' if L > 1 else ''}: pass " + (f"num_layers {fewer}, or " if fewer else "") + choose,
                    "num_layers", "target_layer_ids")
    faults = []
    if len(set(ids)) < len(ids):
        faults.append("repeat layers")
    if any(a > b for a, b in zip(ids, ids[1:])):
        faults.append("are not in increasing order")
    return ids, (f"WARNING: the default target layers of a {n}-layer drafter for this {L}-layer target are {_ids_said(ids)} "
                 f"({rule}), which {' and '.join(faults)}: {choose}" + (f", or pass num_layers {fewer}" if fewer else ""))


def make_drafter_config(target_cfg: TargetConfig, cfg: TrainConfig, mask_token_id: int, warn=None) -> DrafterConfig:
    """A drafter shaped like the target's layers (hidden size, heads, RoPE), ``num_layers`` deep,
    with the DFlash 2 modules for ``--arch dflash2`` (:func:`dflash2_settings`).

    Its ``fc`` reads each target layer's whole feature row (``target_hidden_size`` where the
    target's layers carry several residual streams, e.g. GLM-5.3-Flash, DeepSeek-V4); its
    head size is the target's ``head_dim``, else (a position-free target's 0)
    ``hidden_size / num_attention_heads``. Its MLP width is ``--intermediate-size``, else the target's dense MLP width, else (a
    target whose every MLP is a mixture of experts) the width a token passes through:
    ``top_k * moe_intermediate_size + shared_expert_intermediate_size``. Its target layers
    are ``--target-layer-ids``, else :func:`default_layer_ids`, whose warning (if any) goes
    to ``warn`` once the whole config is valid.

    Raises:
        OptionError: ``target_layer_ids`` empty or naming layers outside the target's,
            ``init_from_target`` with more ``num_layers`` than the target has, ``block_size``
            below 2 (named as fields; the command line names the flags).
        DFlashError: default target layers outside the target's.
    """
    L = target_cfg.num_hidden_layers
    if cfg.init_from_target and cfg.num_layers > L:
        raise OptionError(f"init_from_target copies the target's last num_layers layers: at most {L}, "
                          f"got {cfg.num_layers}", "init_from_target", "num_layers")
    note = None
    if cfg.target_layer_ids is None:  # (the DFlash rule: it fails, or repeats layers, on shallow targets)
        layer_ids, note = default_layer_ids(L, cfg.num_layers)
    else:
        layer_ids = cfg.target_layer_ids
        if not layer_ids:  # (an empty --target-layer-ids "" fell back to the rule unsaid)
            raise OptionError("target_layer_ids needs at least one target layer id", "target_layer_ids")
        bad = [i for i in layer_ids if not 0 <= i < L]
        if bad:
            # (the field in the Python API, the flag on the command line: it named the flag in both, trial-249)
            raise OptionError(f"target_layer_ids {bad} outside the target's {L} layers", "target_layer_ids")
    if cfg.block_size < 2:
        raise OptionError(f"block_size must be >= 2, got {cfg.block_size}", "block_size")
    dcfg = DrafterConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim or target_cfg.hidden_size // target_cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size or _mlp_width(target_cfg),
        rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta, rope_scaling=target_cfg.rope_scaling,
        attention_bias=False, block_size=cfg.block_size, mask_token_id=mask_token_id,
        target_layer_ids=list(layer_ids), num_target_layers=L, vocab_size=target_cfg.vocab_size,
        sliding_windows=[None] * cfg.num_layers, max_position_embeddings=target_cfg.max_position_embeddings,
        dflash2=dflash2_settings(cfg, target_cfg.hidden_size, target_cfg.vocab_size),
        # (a target whose layers carry several residual streams: fc reads them all, target_hidden_size in config.json)
        target_hidden_size=None if target_cfg.feature_size == target_cfg.hidden_size else target_cfg.feature_size,
    )
    if note and warn is not None:
        warn(note)
    return dcfg


# the drafter config.json keys that TrainConfig fields (training flags) set, and the field (the others come from the
# target)
DRAFTER_FLAGS = {"architectures": "arch", "num_hidden_layers": "num_layers", "block_size": "block_size",
                 "target_layer_ids": "target_layer_ids", "intermediate_size": "intermediate_size",
                 "mask_token_id": "mask_token_id", "conv_kernel_size": "conv_kernel_size",
                 "conv_group_size": "conv_group_size", "selector_rank": "selector_rank",
                 "selector_top_k": "selector_top_k"}
SHAPE_KEYS = ("num_hidden_layers", "block_size", "target_layer_ids", "intermediate_size", "mask_token_id")


def drafter_config_differences(here: dict, there: dict, init_from: bool = False,
                               derived: dict[str, tuple[str, str]] | None = None) -> dict[str, str]:
    """What differs between two drafter ``config.json`` dicts (this run's and a checkpoint's):
    ``{key: text}``, one entry a setting, in the fields' order, its text naming it by its
    :class:`TrainConfig` field where one sets it (``num_layers 2 here, 1 in the checkpoint``; the
    command line names the flags: :func:`differences_names`), else by its key (the target's, or
    with ``init_from`` the ``init_from`` drafter's, shape). ``derived`` maps the keys whose
    field this run was not given to ``(name, origin)``: their text names where this run's
    value came from instead (``target layers 1,3 here (the default of num_layers 2;
    target_layer_ids not given), 3 in the checkpoint``). ``max_position_embeddings`` is
    compared only where both dicts have one (a drafter whose RoPE reads it has one; an
    ``--init-from`` run's drafter lacked it where its source did)."""
    def flat(d: dict) -> dict:
        out = {k: v for k, v in d.items() if k != "dflash_config"}
        out.update(d.get("dflash_config") or {})
        if isinstance(out.get("architectures"), list):
            out["architectures"] = {"DFlash2DraftModel": "dflash2", "DFlashDraftModel": "dflash"}.get(
                out["architectures"][0], out["architectures"][0])
        return out

    a, b = flat(here), flat(there)
    # (use_sliding_window follows the windows, which are compared: a checkpoint saved before it was written lacks it)
    a.pop("use_sliding_window", None), b.pop("use_sliding_window", None)
    if a.get("max_position_embeddings") is None or b.get("max_position_embeddings") is None:
        # (an --init-from run's drafter lacked it where its source did: the RoPE then reads none, and a resume named
        # "max_position_embeddings 4096 here, None in the checkpoint" beside the settings that differ)
        a.pop("max_position_embeddings", None), b.pop("max_position_embeddings", None)
    skip = {"layer_types"} if a.get("num_hidden_layers") != b.get("num_hidden_layers") else set()  # (one per layer)
    if a.get("architectures") != b.get("architectures"):  # (the DFlash 2 keys of one side only)
        skip |= a.keys() ^ b.keys()
    def show(v) -> str:  # (as the flag takes it)
        return _ids_text(v) if isinstance(v, list) else "none" if v is None else str(v)

    order = list(DRAFTER_FLAGS)  # (the flags first, in this order)
    out = {}
    for key in sorted(a.keys() | b.keys(), key=lambda k: (order.index(k) if k in order else len(order), k)):
        if key in skip or a.get(key) == b.get(key):
            continue
        flag = DRAFTER_FLAGS.get(key)
        if flag and not (init_from and key in SHAPE_KEYS):  # (with --init-from the shape is the source drafter's)
            if key in (derived or {}):  # (a flag not given: its text named it as if it were, trial-222)
                name, origin = derived[key]
                out[key] = f"{name} {show(a.get(key))} here ({origin}), {show(b.get(key))} in the checkpoint"
                continue
            out[key] = f"{flag} {show(a.get(key))} here, {show(b.get(key))} in the checkpoint"
        else:
            out[key] = f"{key} {a.get(key)!r} here, {b.get(key)!r} in the checkpoint"
    return out


def differences_names(differ: dict[str, str], init_from: bool, derived: dict[str, tuple[str, str]]) -> list[str]:
    """The fields the texts of :func:`drafter_config_differences` (of the same ``init_from`` and
    ``derived``) name, which the command line names as flags; not a key it names as the key (a
    shape setting with ``init_from``: the drafter's ``block_size``, not the field)."""
    origins = {"target_layer_ids": ["num_layers", "target_layer_ids"]}  # (the default of num_layers N; ... not given)
    names = []
    for key in differ:
        if key in DRAFTER_FLAGS and not (init_from and key in SHAPE_KEYS):
            names += origins.get(key, [key]) if key in derived else [DRAFTER_FLAGS[key]]
    return names


def _flat_config(d: dict) -> dict:
    """A drafter ``config.json`` dict with its ``dflash_config`` keys at the top level."""
    out = {k: v for k, v in d.items() if k != "dflash_config"}
    out.update(d.get("dflash_config") or {})
    return out


def checkpoint_shape(cfg: TrainConfig, saved: dict) -> dict:
    """The shape settings a resume of ``cfg`` without ``init_from`` takes from the checkpoint's
    drafter ``config.json`` dict ``saved``, where its run started from an ``init_from`` drafter
    (which set them): ``{field: value}`` for each of ``num_layers``, ``block_size`` (at their
    defaults in ``cfg``), ``target_layer_ids``, ``intermediate_size``, ``mask_token_id`` (None in
    ``cfg``), and with ``arch="dflash2"`` the :data:`DFLASH2_SIZES` (at their defaults), that
    ``saved`` holds; a field set in ``cfg`` is compared with the checkpoint's instead."""
    flat = _flat_config(saved)
    keys = {"num_layers": "num_hidden_layers", "block_size": "block_size", "target_layer_ids": "target_layer_ids",
            "intermediate_size": "intermediate_size", "mask_token_id": "mask_token_id"}
    if cfg.arch == "dflash2":
        keys.update({k: k for k in DFLASH2_SIZES})
    defaults = TrainConfig.__dataclass_fields__
    taken = {}
    for field, key in keys.items():
        if flat.get(key) is not None and getattr(cfg, field) == defaults[field].default:
            taken[field] = list(flat[key]) if field == "target_layer_ids" else flat[key]
    return taken


TRAINING_BYTES_PER_PARAMETER = 16
"""Bytes a drafter parameter takes while it trains: its float32 weight, its float32 gradient
and AdamW's two float32 moments."""

ALLOCATOR_FACTOR = 1.5
"""What the training state and a step's activations are multiplied by in
:func:`training_memory`: the peak resident memory of CPU runs grows over their first steps
past the sum (the allocator keeps the memory of a step's freed activations and of the
optimizer's temporaries, which the next steps' tensors of other sizes do not all reuse); runs of
a 400-layer drafter of hidden size 64 measured about 1.2 times it, with the other terms."""


RUN_OVERHEAD = 1 << 28
"""Bytes a training run takes beyond its drafter's state and activations (the data steps, the
evaluation, torch's own): 256 MiB, above the 0.12 GB measured of a one-layer drafter's run."""


def drafter_parameters(dcfg: DrafterConfig) -> int:
    """The number of parameters of a drafter of ``dcfg``: counted on meta-device builds of one
    and two of its layers (no memory) and extrapolated to ``num_hidden_layers`` (its layers
    have the same parameters each), so that a config of 100,000 layers is counted at once."""
    def count(k: int) -> int:
        small = replace(dcfg, num_hidden_layers=k, sliding_windows=dcfg.sliding_windows[:k],
                        causal_layers=(dcfg.causal_layers or [False] * dcfg.num_hidden_layers)[:k])
        with torch.device("meta"):
            model = drafter_class(small)(small)
        return sum(p.numel() for p in model.parameters())

    n = dcfg.num_hidden_layers
    if n <= 2:
        return count(n)
    one, two = count(1), count(2)
    return one + (n - 1) * (two - one)


def activation_bytes(dcfg: DrafterConfig, cfg: TrainConfig) -> int:
    """A bound on the bytes a training step's forward keeps for its backward (float32, 4 bytes a
    value), for ``batch`` sequences of ``seq_len`` tokens (context rows ``C = batch * seq_len``)
    with ``anchors_per_seq`` blocks of ``block_size`` rows each (block rows ``R``): per drafter
    layer, four copies of the attention scores (``heads x R x (seq_len + block_size)``: the scores,
    the masked scores, the softmax and its context slice), four of each block row's widths
    (hidden, MLP, query and key/value heads) and two of each context row's (hidden, keys and
    values); once, the draft logits three times (``R x vocab``: logits, log-softmax, gradient)."""
    b, T, B = cfg.batch, cfg.seq_len, dcfg.block_size
    n = min(cfg.anchors_per_seq, T)
    rows, ctx = b * n * B, b * T
    H, heads, kv, hd = dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim
    scores = heads * rows * (T + B)
    block = rows * (2 * H + dcfg.intermediate_size + (heads + 2 * kv) * hd)
    context = ctx * (H + 2 * (heads + kv) * hd)
    per_layer = 4 * scores + 4 * block + 2 * context
    features = ctx * (dcfg.target_hidden_size or H) * len(dcfg.target_layer_ids)
    return 4 * (dcfg.num_hidden_layers * per_layer + 3 * rows * dcfg.vocab_size + features)


def training_memory(dcfg: DrafterConfig, cfg: TrainConfig) -> tuple[int, int, int]:
    """The CPU memory, in bytes, a run of ``cfg`` training a drafter of ``dcfg`` needs beyond the
    target (and an ``init_from`` drafter) already loaded, and its parts: ``(need, parameters,
    activations)``. ``need`` is :data:`ALLOCATOR_FACTOR` times the training state
    (:data:`TRAINING_BYTES_PER_PARAMETER` bytes a parameter, plus a bfloat16 copy of the weights
    under ``autocast``) and :func:`activation_bytes`, plus what the export adds (the weights
    cast to ``save_dtype`` and their serialized bytes) and :data:`RUN_OVERHEAD`. The data, prepared later, is not
    counted (its tokens are a small share of the text's size)."""
    from ..options import resolve_save_dtype

    n = drafter_parameters(dcfg)
    state = n * (TRAINING_BYTES_PER_PARAMETER + (2 if cfg.autocast else 0))
    act = activation_bytes(dcfg, cfg)
    export = 2 * n * resolve_save_dtype(cfg.save_dtype).itemsize
    return int(ALLOCATOR_FACTOR * (state + act)) + export + RUN_OVERHEAD, n, act


def check_drafter_fits(dcfg: DrafterConfig, cfg: TrainConfig) -> None:
    """Refuse, in one line, a drafter of ``dcfg`` whose training (:func:`training_memory`: its
    float32 weights, gradients and AdamW moments, a step's activations, the export's copy,
    and what the allocator does not reuse) exceeds what
    :func:`~dflash_torch.checkpoint.available_memory` leaves on the CPU now, the target already
    loaded: it failed with an allocator's traceback once the data was prepared, or (activations
    left out) was killed by the OS without a word (trial-293). The line names the figures and
    the fields that set the size (``intermediate_size`` and ``num_layers``; with ``init_from``,
    that drafter, whose shape it is; ``batch``, ``seq_len`` and ``anchors_per_seq`` where the
    activations are most of it), which the command line names as its flags
    (``--intermediate-size`` ...).

    Raises:
        OptionError: ``the drafter needs 6.2 TB to train (192,000,016,672 parameters at 16 bytes
            each: ...; ...); cpu has 12.3 GB free beside the target: give a smaller
            intermediate_size (...) or num_layers (...)``.
    """
    need, n, act = training_memory(dcfg, cfg)
    free = checkpoint.available_memory("cpu")
    if free is None or need <= free:
        return
    # (the fields in the Python API, the flags on the command line: it named the flags in both, trial-249)
    if cfg.init_from:
        fix = (f"its shape is the init_from drafter's ({cfg.init_from}): start from a smaller drafter, or train "
               "one from scratch with num_layers and intermediate_size")
        names = ["init_from", "num_layers", "intermediate_size"]
    else:
        width = f"now {dcfg.intermediate_size}" if cfg.intermediate_size is not None else \
            f"the default, the target's {dcfg.intermediate_size}"
        fix = f"give a smaller intermediate_size ({width}) or num_layers (now {dcfg.num_hidden_layers})"
        names = ["intermediate_size", "num_layers"]
    if act > n * TRAINING_BYTES_PER_PARAMETER:  # (the activations are most of it: a smaller step helps too)
        fix += (f", or a smaller batch (now {cfg.batch}), seq_len (now {cfg.seq_len}) or anchors_per_seq "
                f"(now {cfg.anchors_per_seq})")
        names += ["batch", "seq_len", "anchors_per_seq"]
    raise OptionError(f"the drafter needs {memory_text(need)} to train ({n:,} parameters at "
                      f"{TRAINING_BYTES_PER_PARAMETER} bytes each: float32 weights, gradients and AdamW's two moments; "
                      f"{memory_text(act)} of activations a step; 1.5 times these, as the allocator keeps freed memory; the "
                      f"export's copy; the run's own); cpu has {memory_text(free)} free beside the target: {fix}",
                      *names)


def invocations(st: dict | None, command: str | None, recorded: dict) -> list[dict]:
    """The ``runs`` list that the checkpoint and ``training_log.json`` keep: one entry an
    invocation of the run, in order. The first: ``{"command", "start_step": 0, "config"}`` (its
    whole recorded config); each resume's: ``{"command", "start_step", "changed"}``, the step it
    went on from and the recorded config values that differ from the previous invocation's
    (``{"lr": 0.002, "steps": 20, "resume": true}``). ``command`` is the command line (None from
    the Python API); ``st`` the checkpoint resumed (None for a new run), whose own ``runs``
    it extends (a checkpoint saved before they were kept starts the list with its run, whose
    command is unknown: None); ``recorded`` this invocation's recorded config. (Only the last
    invocation's command and config were kept: trial-293.)"""
    if st is None:
        return [{"command": command, "start_step": 0, "config": recorded}]
    before = st.get("train_config") or {}
    kept = st.get("runs")
    runs = [dict(r) for r in kept] if isinstance(kept, list) and kept else \
        [{"command": None, "start_step": 0, "config": before}]
    changed = {k: v for k, v in recorded.items() if k not in before or before[k] != v}
    runs.append({"command": command, "start_step": st["step"], "changed": changed})
    return runs


def same_init_source(a: str | None, b: str | None) -> bool:
    """Whether two ``init_from`` values name the same drafter: equal, or paths that resolve
    to the same place (``d`` and ``./d/``); ``None`` (no ``--init-from``) equals only itself."""
    if a == b:
        return True
    if a is None or b is None:
        return False
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError):  # (a path that cannot be resolved: the words decide)
        return False


def load_init_drafter(cfg: TrainConfig, target_cfg: TargetConfig, tokenizer=None,
                      src_dir: Path | None = None) -> tuple[DFlashDrafter, DrafterConfig]:
    """The ``--init-from`` drafter (float32) and the config of the drafter to train: the
    source's shape (layers, block size, target layers, mask token, MLP width, RoPE) with
    the modules of ``--arch`` (a DFlash 2 source keeps its own convolution and selector sizes).
    ``src_dir``: the source's directory where it is resolved already (else ``init_from`` is).

    Raises:
        OptionError: ``num_layers`` or ``block_size`` (for a DFlash 2 source its
            :data:`DFLASH2_SIZES` too) set to another value than its default and the source's;
            a config that is no drafter's (a target's: ``init_from 'D': the drafter checkpoint is
            not a DFlash drafter ...``) or cannot be read, naming ``init_from``.
        DFlashError: a checkpoint that does not load or does not fit the target, a
            DFlash 2 source with ``--arch dflash`` (its modules would be dropped), a
            Speculators-format or Laguna DFlash source, or one with its own embedding table
            or LM head; a source whose weights do not load (missing, unknown, of another
            shape than its config implies, ...) as ``--init-from D: drafter weight ...``.
    """
    if src_dir is None:
        src_dir = checkpoint_dir(cfg.init_from, "init_from")
    try:  # (a target's, or another model's: "the drafter checkpoint is not a DFlash drafter" named no flag, trial-293)
        raw = load_config(src_dir)
        if tokenizer is not None and needs_mask_token_id(raw):  # (its mask token, looked up as the engine does)
            raw, _ = fill_mask_token_id(raw, tokenizer, target_cfg.vocab_size)
        src_cfg = DrafterConfig.from_dict(raw)
    except OptionError:
        raise
    except DFlashError as exc:
        raise OptionError(f"init_from {quoted(cfg.init_from)}: {exc}", "init_from") from None
    # (a num_layers=5 or block_size=8 trained the source's 3 layers and B=16 unsaid, and training_log.json recorded 5
    # and 8; so did --selector-top-k 4 for a DFlash 2 source's 16: trial-259)
    theirs = {"num_layers": src_cfg.num_hidden_layers, "block_size": src_cfg.block_size}
    if src_cfg.dflash2 is not None:
        theirs.update({k: getattr(src_cfg.dflash2, k) for k in DFLASH2_SIZES})
    for key, value in theirs.items():
        if getattr(cfg, key) not in (value, TrainConfig.__dataclass_fields__[key].default):
            raise named(f"{key} {getattr(cfg, key)} cannot be combined with init_from {quoted(cfg.init_from)}, whose "
                        f"{key} is {value}: the drafter's shape comes from it (leave {key} at its default, "
                        f"or give {value})", key, "init_from")
    if src_cfg.speculators is not None:  # (its own embedding / LM head / attention rules: not this trainer's format)
        raise OptionError(f"init_from {quoted(cfg.init_from)} is a Speculators-format drafter; dflash-torch trains "
                          "DFlash-format drafters (initialize from one of those, or train from scratch)", "init_from")
    if src_cfg.laguna is not None:  # (its aux norms, output gate and context input norm: not this trainer's format)
        raise OptionError(f"init_from {quoted(cfg.init_from)} is a Laguna DFlash drafter; dflash-torch trains "
                          "DFlash-format drafters (initialize from one of those, or train from scratch)", "init_from")
    try:
        validate_pair(target_cfg, src_cfg)
    except DFlashError as exc:  # (it said only "incompatible pair: drafter hidden_size 256 != ...", no flag named)
        raise OptionError(f"init_from {quoted(cfg.init_from)} does not fit the target ({exc})", "init_from") from None
    if src_cfg.dflash2 is not None and cfg.arch != "dflash2":
        raise OptionError(f"init_from {quoted(cfg.init_from)} is a DFlash 2 drafter; train it with arch dflash2", "init_from",
                          "arch")
    try:
        source = DFlashDrafter.from_pretrained(src_dir, torch.float32, config=raw, parsed=src_cfg)
    except DFlashError as exc:  # ("drafter weight layers.0.mlp.gate_proj.weight has shape ...": no flag named, trial-249)
        raise OptionError(f"init_from {quoted(cfg.init_from)}: {exc}", "init_from") from None
    if source.config.own_embedding or source.config.own_lm_head:  # (this trainer's drafters read the target's)
        raise OptionError(f"init_from {quoted(cfg.init_from)} ships its own embedding table / LM head; dflash-torch trains "
                          "drafters that read the target's (initialize from one without, or train from scratch)",
                          "init_from")
    # (a source without max_position_embeddings takes the target's, as a fresh run's drafter does: its export lacked
    # it, and a resume then named it beside the settings that differ; where the source's RoPE reads it, it has one)
    dcfg = replace(src_cfg, vocab_size=target_cfg.vocab_size, num_target_layers=target_cfg.num_hidden_layers,
                   max_position_embeddings=src_cfg.max_position_embeddings or target_cfg.max_position_embeddings)
    if src_cfg.dflash2 is None:
        dcfg.dflash2 = dflash2_settings(cfg, target_cfg.hidden_size, target_cfg.vocab_size)
    return source, dcfg


@torch.no_grad()
def copy_drafter(drafter: DFlashDrafter, source: DFlashDrafter) -> list[str]:
    """Copy every weight of ``source`` into ``drafter`` (same backbone shape); returns the
    names ``drafter`` has that ``source`` lacks (a DFlash 2 drafter's modules, left as they
    are: identity convolutions and small random codebooks after :func:`init_drafter_weights`)."""
    dst = drafter.state_dict()
    src = source.state_dict()
    for k, v in src.items():
        dst[k].copy_(v)
    return sorted(dst.keys() - src.keys())


def _layers_text(word: str, ids: list[int]) -> str:
    return f"{word}{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def init_from_target_note(copied: list[tuple[int, int, str | None]]) -> str:
    """The line that says what ``init_from_target`` (``--init-from-target``) copied (:func:`copy_target_layers`'s
    result): which drafter layers start as which target layers, and why the others do not;
    a WARNING where none does."""
    kept = [i for i, _, why in copied if why is not None]
    reasons: dict[str, list[int]] = {}
    for _, layer, why in copied:
        if why is not None:
            reasons.setdefault(why, []).append(layer)
    why = "; ".join(f"{_layers_text('target layer', layers)}: {w}" for w, layers in reasons.items())
    done = [(i, layer) for i, layer, w in copied if w is None]
    if not done:
        return (f"init: WARNING: init_from_target copied no layer ({why}); {_layers_text('drafter layer', kept)} "
                f"{_keep(kept)} random initialisation")
    line = (f"init: init_from_target: {_layers_text('drafter layer', [i for i, _ in done])} "
            f"start{'s' if len(done) == 1 else ''} as {_layers_text('target layer', [layer for _, layer in done])}")
    if kept:
        line += f"; {_layers_text('drafter layer', kept)} {_keep(kept)} random initialisation ({why})"
    return line


def _keep(ids: list[int]) -> str:
    return "keeps its" if len(ids) == 1 else "keep their"


def _mlp_width(target_cfg: TargetConfig) -> int:
    """:func:`make_drafter_config`'s default MLP width: the target's dense MLP width where some
    layer has one; else (every MLP a mixture of experts, whose config's ``intermediate_size``
    is then an expert's width, as gpt-oss's, or unused, as a Qwen3-MoE's without
    ``mlp_only_layers``) the width a token passes through."""
    moe = target_cfg.moe
    if moe is None or (not all(target_cfg.moe_layers) and target_cfg.intermediate_size):
        return target_cfg.intermediate_size
    return moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """The learning rate of step ``step`` (from 0): a linear warm-up over ``warmup_steps``
    (``lr * (step + 1) / warmup_steps``), then a cosine from ``lr`` down to ``lr * min_lr_frac``
    along ``progress``, the share of the decay done (0 at the end of the warm-up, 1 at the
    end of the run; clamped to [0, 1]): the lr is ``lr`` at the warm-up's end, its peak, and
    decays from there (the decay counted from step 0 made it jump down there)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = min(max(progress, 0.0), 1.0)
    floor = cfg.lr * cfg.min_lr_frac
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


@contextmanager
def ignored_interrupt():
    """Ignore Ctrl-C (SIGINT) inside the block, and a SIGTERM that interrupts as one
    (:func:`~dflash_torch.cli.interrupt_signals`): a save or export it would cut short goes on,
    whole (a second Ctrl-C while the checkpoint of the first is saved, one while the drafter
    is exported). Only in the main thread (where Python delivers signals); elsewhere the
    block runs as is."""
    main = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in interrupt_signals()} if main else {}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


CACHE_FORMAT = 12  # 3: chat loss masks from character spans; .json record files; 4: notes, conversations left out;
# 5: no reply span inside the turns before it; messages as the engine takes them (parts, tool calls, names);
# 6: replies found by their contents; 7: spans checked against the messages' contents (none on a user's text);
# 8: each reply's closing marker in its span (a reply ending in a line end or ">"); an opening reply's span at its place;
# gpt-oss's last reasoning in its reply's span; a call's empty content left unmarked; 9: also where the template
# writes the marked conversation otherwise (Qwen3's line end before a call after a content); a </s> taken alone;
# 10: a .json array's records named from 1 in the notes (as JSON Lines lines); 11: the mask token's text in the data
# tokenized as plain text (MaskAsText), the mask id in the key; 12: self-distill prompts drawn without replacement,
# distilled sequences that repeat another's tokens left out; records with an empty messages list counted and said
"""Version of the tokenized-data cache; part of its key (bump when tokenization changes)."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def seed_generators(seed: int) -> None:
    """Seed the global ``torch`` and ``random`` generators with ``seed`` (an int of :data:`SEED_RANGE`)."""
    torch.manual_seed(seed)
    random.seed(seed)


def _file_digest(path: Path, unreadable: str | None = None) -> str:
    """The SHA-256 of the file ``path``'s content; ``unreadable`` for one this process may not
    read where given.

    Raises:
        DFlashError: ``path`` cannot be read (without ``unreadable``).
    """
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except PermissionError:
        if unreadable is not None:
            return unreadable
        raise DFlashError(f"cannot read {path}: Permission denied") from None
    except OSError as exc:
        raise DFlashError(f"cannot read {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a link into a directory this process may not enter."""
    try:
        return path.is_file()
    except PermissionError:
        return False


def data_key(cfg: TrainConfig, target_dir: Path, mask_token_id: int | None = None) -> str:
    """Key of the tokenized-data cache: a hash of everything the data is made from (the
    drafter's ``mask_token_id`` too: its text in the data is tokenized as plain text, :func:`_tokenize_data`).

    It holds the SHA-256 of the content of every data file and of every file at the top
    of the target directory (tokenizer, chat template, config; the weight files only
    with ``--self-distill``, which runs the target), plus the settings that shape the
    data. Sizes and mtimes would miss edits that keep both (a same-size edit within the
    file system's timestamp granularity; a file copied or unpacked with its old mtime);
    hashing reads each byte once, about 1 s per GB, far less than tokenizing it.

    A file of the target directory this process may not read counts as "unreadable": one
    that loading needs was refused before, and one it does not (a README.md) may stay so.

    Raises:
        DFlashError: a data path that does not exist or cannot be read.
    """
    target = [[f.name, _file_digest(f, "unreadable")] for f in sorted(target_dir.iterdir())
              if _is_file(f) and (cfg.self_distill or not f.name.endswith(WEIGHT_SUFFIXES))]
    parts = {"format": CACHE_FORMAT, "target": target, "data": [str(Path(os.path.expanduser(p)).resolve()) for p in cfg.data],
             "files": [[str(f.resolve()), _file_digest(f)] for f, _ in corpus_files(cfg.data, cfg.own_dirs())],
             "seq_len": cfg.seq_len, "self_distill": cfg.self_distill, "prefix": [cfg.prefix_min, cfg.prefix_max],
             "seed": cfg.seed, "chat_template_kwargs": cfg.chat_template_kwargs, "mask_token_id": mask_token_id}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def recipe_change(key: str, now, was, block_size: int, cli: bool = False) -> str:
    """A change of the recipe setting ``key`` (a :data:`RECIPE` field) from ``was`` to
    ``now``, naming the field (which :meth:`Trainer.say` names as the command line's flag), a
    default value said so (as the CLI's defaults, the :class:`TrainConfig` field defaults):
    ``gamma 2 (was the default, 3.5)``, ``lr the default, 0.001 (was 0.002)``, ``autocast False
    (was True)``; with ``cli``, autocast as its flag: ``--no-autocast given (was not)``."""
    if key == "autocast":  # (the option is --no-autocast: not the field's name)
        if not cli:
            return f"autocast {now!r} (was {was!r})"
        return "--no-autocast given (was not)" if not now else "--no-autocast left out (was given)"
    if key == "min_lr_frac":  # (no option: a TrainConfig field)
        return f"min_lr_frac {now!r} (was {was!r})"

    def shown(v) -> str:
        if isinstance(v, float):
            return f"{v:g}"
        if isinstance(v, list):
            return " ".join(map(str, v))
        if isinstance(v, dict):
            return f"'{json.dumps(v)}'"
        return str(v)

    def value(v) -> str:
        if v is None:
            return f"the default, {default_gamma(block_size):g}" if key == "gamma" else "not given"
        if v == TrainConfig.__dataclass_fields__[key].default:  # (only --gamma's was said so: trial-175)
            return f"the default, {shown(v)}"
        return shown(v)

    return f"{key} {value(now)} (was {value(was)})"


def check_data_size(cfg: TrainConfig, stream_tokens: int, n_chat: int, n_distilled: int, *, no_turn: int = 0,
                    past_seq_len: int = 0) -> None:
    """Refuse data that cannot fill one training step of ``batch`` sequences plus, with
    ``val_seqs``, one held-out sequence. A window of ``seq_len`` tokens of the text
    stream, a chat conversation and a self-distilled sequence count as one sequence each.
    ``no_turn`` and ``past_seq_len`` count the conversations left out (no assistant turn;
    no assistant reply within ``seq_len`` tokens): named in the error, and with the
    latter it advises a longer ``seq_len``, not a shorter one.

    Raises:
        OptionError: too little data, with the counts and what is needed (naming the fields
            ``batch``, ``seq_len``, ``val_seqs``, which the command line names as flags).
    """
    windows = stream_tokens // cfg.seq_len
    have = windows + n_chat + n_distilled
    if have >= cfg.batch + (1 if cfg.val_seqs else 0):
        return
    parts = [f"{stream_tokens} tokens of text ({windows} windows of seq_len {cfg.seq_len})"]
    left = ([f"{no_turn} with no assistant turn"] if no_turn else []) + \
        ([f"{past_seq_len} with no assistant reply within seq_len {cfg.seq_len} tokens"] if past_seq_len else [])
    if n_chat or left:
        parts.append(f"{n_chat} chat conversations" + (f" (left out: {', '.join(left)})" if left else ""))
    if cfg.self_distill:
        parts.append(f"{n_distilled} self-distilled sequences")
    val = f" and the eval split (val_seqs {cfg.val_seqs}) 1 more" if cfg.val_seqs else ""
    if past_seq_len:  # (a shorter seq_len leaves out more of them)
        fixes = ("add data, lower batch, or raise seq_len so that the conversations' replies fit in it"
                 + (", or pass val_seqs 0" if cfg.val_seqs else ""))
    elif stream_tokens:
        fixes = "add data, or lower batch or seq_len" + (", or pass val_seqs 0" if cfg.val_seqs else "")
    else:  # (a conversation or a self-distilled sequence is one sequence whatever seq_len: a shorter one adds none)
        fixes = ("add data (each conversation or self-distilled sequence is one sequence, whatever seq_len; text "
                 "makes one per seq_len tokens), or lower batch" + (", or pass val_seqs 0" if cfg.val_seqs else ""))
    # (it named the flags in the Python API too: trial-259)
    raise named(f"too little training data: {', '.join(parts)} make {have} sequences; "
                f"one step of batch {cfg.batch} needs {cfg.batch}{val}: {fixes}", "batch", "seq_len", "val_seqs")


def eval_kind(cfg: TrainConfig, stream: torch.Tensor, chat: list, distilled: list) -> tuple[str, dict[str, int]]:
    """The kind of sequences :func:`split_eval` holds out (``"distilled"``, ``"chat"`` or
    ``"text"``) and the count of each kind (``"text"``: windows of ``seq_len`` tokens)."""
    counts = {"distilled": len(distilled), "chat": len(chat), "text": stream.numel() // cfg.seq_len}
    return next((k for k, c in counts.items() if c >= 5), max(counts, key=counts.get)), counts


def covered_rows(examples: list[Example]) -> set[tuple[int, ...]]:
    """The token sequences (tuples of ids) of ``examples`` that another example's tokens
    repeat or begin with: equal to another's, or a prefix of it (a one-turn conversation
    that is the first turn of a longer one in the same data: trial-275). Such a row, held
    out, would be scored on tokens a training row trains on.

    Sorted, a sequence is a prefix of another exactly when it is one of its lexicographic
    successor's (the sequences starting with it follow it), so this costs a sort.
    """
    times = Counter(tuple(e.ids.tolist()) for e in examples)
    rows = sorted(times)
    return {r for r, nxt in zip(rows, rows[1:] + [()]) if times[r] > 1 or nxt[:len(r)] == r}


def split_eval(cfg: TrainConfig, stream: torch.Tensor, chat: list[Example], distilled: list[Example]):
    """Set apart up to ``val_seqs`` sequences for the acceptance estimate.

    They come from the self-distilled sequences, else the chat ones, else windows of
    the stream's tail: the first kind with at least 5 sequences (the largest kind
    otherwise); at least one, at most a fifth of that kind (a tenth of the windows), and
    never so many that fewer than ``batch`` sequences are left to train on (see
    :func:`check_data_size`). A chat or self-distilled sequence whose tokens another
    sequence repeats, or begins with (a prefix of another's: :func:`covered_rows`), is never
    held out (it stays to train on): a held-out row never copies a training row, nor the
    start of one (trial-272, trial-275); fewer are held out where the others are all such.

    Returns:
        ``(stream, chat, distilled, val_rows, copies)``: what is left to train on, the
        held-out ``(ids, loss_mask)`` rows, and how many sequences of the kind held out from
        were not held out as copies (0 for windows of the text, which are not checked).
    """
    if not cfg.val_seqs:
        return stream, chat, distilled, [], 0
    kind, counts = eval_kind(cfg, stream, chat, distilled)
    k = min(cfg.val_seqs, max(1, counts[kind] // (10 if kind == "text" else 5)), sum(counts.values()) - cfg.batch)
    if kind == "text":
        cut = stream.numel() - k * cfg.seq_len
        rows = [(w, torch.ones(w.numel(), dtype=torch.bool)) for w in stream[cut:].split(cfg.seq_len)]
        return stream[:cut], chat, distilled, rows, 0
    examples = distilled if kind == "distilled" else chat
    covered = covered_rows(chat + distilled)
    free = [i for i, e in enumerate(examples) if tuple(e.ids.tolist()) not in covered]
    held = set(free[len(free) - min(k, len(free)):])  # (the last k that no other sequence covers)
    rows = [(examples[i].ids, examples[i].loss_mask) for i in sorted(held)]
    kept = [e for i, e in enumerate(examples) if i not in held]
    copies = len(examples) - len(free)
    return (stream, chat, kept, rows, copies) if kind == "distilled" else (stream, kept, distilled, rows, copies)


def _strings(obj) -> Iterator[str]:
    """Every string in ``obj`` (a message: its content, reasoning, tool calls' arguments...)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def mask_text_note(corpus: Corpus, text: str, mask_token_id: int, as_text: bool) -> str | None:
    """The line said where the data holds ``text``, the mask token's (None where it does not):
    how often, where first, and whether it is tokenized as plain text (``as_text``,
    :class:`~dflash_torch.training.data.MaskAsText`) or, where the tokenizer cannot, becomes the mask id."""
    counts = [(corpus.document_source(i), d.count(text)) for i, d in enumerate(corpus.documents) if text in d]
    counts += [(corpus.source(i), sum(s.count(text) for s in _strings(c))) for i, c in enumerate(corpus.conversations)]
    counts = [(where, n) for where, n in counts if n]
    if not counts:
        return None
    total = sum(n for _, n in counts)
    where, first = counts[0]
    seen = (f"{total} time{'s' * (total != 1)} in the data ({first} in {where}"
            + (f" and {total - first} more in {len(counts) - 1} other source{'s' * (len(counts) != 2)})" if len(counts) > 1
               else ")"))
    if as_text:
        return (f"data: the text {text!r}, the mask token's, occurs {seen}; it is tokenized as plain text there, not "
                f"as the mask token id {mask_token_id}, which stands for masked slots only")
    return (f"data: WARNING: the text {text!r}, the mask token's, occurs {seen}; this tokenizer makes it the mask token "
            f"id {mask_token_id}, so the drafter reads it as a masked slot and learns to draft that id: take it out of "
            "the data, or pass mask_token_id with an id no text maps to")


def _tokenize_data(cfg: TrainConfig, target_dir: Path, tokenizer, say, mask_token_id: int | None = None) -> dict:
    """Read, tokenize and self-distill the data (the blob :func:`prepare_data` caches).

    The text of the mask token ``mask_token_id`` (an added token, e.g. ``<|MASK|>``) in the
    data is tokenized as plain text (:func:`~dflash_torch.training.data.mask_as_text`), said
    in a line (a WARNING where the tokenizer cannot: :func:`mask_text_note`).

    Its ``notes`` are the lines said about the data (files skipped, conversations left
    out or trained on all their tokens), said again when the blob is loaded from the cache."""
    t0 = time.time()
    notes: list[str] = []

    def note(line: str, *names: str) -> None:  # (kept with the fields it names: said again as flags, or as fields)
        notes.append([line, *names])
        say(line, *names)

    corpus = read_corpus(cfg.data, cfg.own_dirs())
    tokenizer, mask_text = mask_as_text(tokenizer, mask_token_id)
    said = mask_text_note(corpus, mask_text, mask_token_id, isinstance(tokenizer, MaskAsText)) if mask_text else None
    if said:
        note(said, "mask_token_id")
    for d in corpus.excluded:
        note(f"data: did not read {quoted(d)} (this run's out or work_dir) nor anything below it", "out", "work_dir")
    if corpus.skipped:
        n = len(corpus.skipped)
        note(f"data: skipped {n} file{'s' * (n != 1)} that {'are' if n != 1 else 'is'} not UTF-8 text"
             f"{', e.g.' if n != 1 else ':'} {corpus.skipped[0]}")
    if corpus.empty_conversations:
        n = len(corpus.empty_conversations)
        note(f"data: {n} record{'s have' if n != 1 else ' has'} an empty messages list, e.g. "
             f"{corpus.empty_conversations[0]}; left out")
    stream = tokenize_documents(tokenizer, corpus.documents)
    has_turn = [any(t["role"] == "assistant" for t in m) for m in corpus.conversations]
    replied = [i for i, h in enumerate(has_turn) if h]
    no_turn = len(has_turn) - len(replied)
    if no_turn:  # (no token of theirs carries loss; they trained on all their tokens, unsaid)
        first = has_turn.index(False)
        still = "; self_distill still takes prompts from them" if cfg.self_distill else ""
        note(f"data: {no_turn} conversation{'s have' if no_turn > 1 else ' has'} no assistant turn, e.g. "
             f"{corpus.source(first)}; left out (a conversation's loss lies on its assistant turns{still})",
             *(["self_distill"] if still else []))
    chat = [tokenize_conversation(tokenizer, corpus.conversations[i], cfg.seq_len, corpus.source(i),
                                  cfg.chat_template_kwargs) for i in replied]
    whole = [corpus.source(i) for i, e in zip(replied, chat) if e.whole]
    if whole:  # (their user and system text is trained on too)
        note(f"data: WARNING: {len(whole)} of {len(chat)} conversations have assistant turns not found apart from the "
             f"other messages' text in the chat template's rendering, e.g. {whole[0]}; the loss covers all their tokens")
    past = sum(not e.loss_mask.any() for e in chat)
    if past:
        note(f"data: {past} conversation{'s have' if past > 1 else ' has'} no assistant reply within seq_len "
             f"{cfg.seq_len} tokens; left out", "seq_len")
        chat = [e for e in chat if e.loss_mask.any()]
    left_out = {"no_turn": no_turn, "past_seq_len": past}
    distilled: list[Example] = []
    drawn: dict = {}
    dropped = 0
    if cfg.self_distill > 0:
        from .distill import distill_prompts, self_distill

        check_data_size(cfg, stream.numel(), len(chat), cfg.self_distill, **left_out)  # before the costly part
        prompts, is_chat = distill_prompts(tokenizer, corpus, cfg.self_distill, cfg.seq_len, prefix_min=cfg.prefix_min,
                                           prefix_max=cfg.prefix_max, seed=cfg.seed,
                                           template_kwargs=cfg.chat_template_kwargs, counts=drawn)
        if not prompts:
            shortest = max(1, min(cfg.prefix_min, cfg.prefix_max, cfg.seq_len - 16) // 2)
            chat_too = f", and no chat prompt is shorter than seq_len - 16 = {cfg.seq_len - 16} tokens" if chat else ""
            raise named(f"self_distill {cfg.self_distill} found no prompt in the data: no text passage of "
                        f"{shortest} tokens (half of prefix_min) follows a line start{chat_too}; "
                        "add data or lower prefix_min", "self_distill", "prefix_min", "seq_len")
        if len(prompts) < cfg.self_distill:
            few = drawn.get("chat_distinct", 0) < drawn.get("chat_asked", 0)
            why = (f" (the conversations give {drawn['chat_distinct']} distinct chat prompts, each drawn once"
                   + (f", {drawn['chat_repeated']} repeated ones left out" if drawn["chat_repeated"] else "")
                   + ": a repeated prompt's greedy continuation would repeat its sequence)") if few else ""
            note(f"data: self-distill found only {len(prompts)} of {cfg.self_distill} prompts in the data{why}")
            check_data_size(cfg, stream.numel(), len(chat), len(prompts), **left_out)
        t1 = time.time()
        made = self_distill(target_dir, tokenizer, prompts, is_chat, cfg.seq_len,
                            batch_size=cfg.self_distill_batch, progress=cfg.progress)
        seen: set[tuple[int, ...]] = set()
        for e in made:  # (distinct prompts may still be continued into the same tokens: one kept)
            ids = tuple(e.ids.tolist())
            if ids not in seen:
                seen.add(ids)
                distilled.append(e)
        dropped = len(made) - len(distilled)
        say(f"data: self-distilled {len(distilled)} sequences in {time.time() - t1:.0f}s"
            + (f" ({dropped} more repeated another's tokens and were left out)" if dropped else ""))
    return {"stream": stream, "chat": [(e.ids, e.loss_mask) for e in chat],
            "distilled": [(e.ids, e.loss_mask) for e in distilled], "notes": notes,
            "stats": {"documents": len(corpus.documents), "conversations": len(corpus.conversations),
                      "conversations_empty": len(corpus.empty_conversations),
                      "conversations_without_assistant_turn": no_turn, "conversations_reply_past_seq_len": past,
                      "conversations_on_all_tokens": len(whole),
                      "skipped_files": len(corpus.skipped), "stream_tokens": int(stream.numel()),
                      "distilled_sequences": len(distilled),
                      "distilled_chat_prompts_distinct": drawn.get("chat_distinct", 0),
                      "distilled_duplicates_removed": dropped,
                      "distilled_tokens": sum(int(e.loss_mask.sum()) for e in distilled),
                      "prepare_time_s": round(time.time() - t0, 1)}}


def _load_data_cache(cache: Path, log) -> dict | None:
    """The data cache ``cache`` (as :func:`prepare_data` saves it), else None where it cannot
    be read back (this process may not read it; truncated, empty, not such a cache), said to
    ``log`` as a WARNING: it is made again."""
    try:
        blob = torch.load(cache, weights_only=True)  # (tensors and plain values: a pickle of other objects could run code)
        if not (isinstance(blob, dict) and {"stream", "chat", "distilled", "notes", "stats"} <= blob.keys()):
            raise ValueError("not a data cache")
    except Exception as exc:  # (torch.load raises many types for a damaged file)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else (str(exc).strip().splitlines() or
                                                                            [type(exc).__name__])[0].split(". ")[0]
        log(f"data: WARNING: cannot read back {cache} ({why}); making it again")
        return None
    return blob


def _distilled_in(cache: Path) -> int:
    """The number of self-distilled sequences the data cache ``cache`` holds (its tensors mapped,
    not read); 0 for one that cannot be read back, or a partial ``.tmp`` file."""
    if cache.suffix != ".pt":
        return 0
    try:
        blob = torch.load(cache, weights_only=True, mmap=True)
        return len(blob["distilled"])
    except Exception:  # (damaged, or not a data cache: nothing costly to keep)
        return 0


def prepare_data(cfg: TrainConfig, target_dir: Path, tokenizer, log,
                 mask_token_id: int | None = None, say=None) -> tuple[TrainingData, list, dict]:
    """Tokenized (and self-distilled) data (the text of the drafter's mask token
    ``mask_token_id`` in it as plain text: :func:`_tokenize_data`), cached in the work dir under :func:`data_key`
    (a new cache replaces the work dir's older ones once the data passed :func:`check_data_size`,
    and one that cannot be read back, with a WARNING; an older one holding self-distilled
    sequences, costly to make again, is kept, in a line), and a validation set (:func:`split_eval`).

    ``log`` is called with each line said; ``say``, where given, instead with a line that
    names fields and the fields (``say(line, *names)``: :meth:`Trainer.say`, which names them
    as the command line's flags).

    Raises:
        DFlashError: unreadable or malformed data (naming the file), or too little of it
            (:func:`check_data_size`; checked before self-distillation too); a cache that
            cannot be written (a full disk: naming it and the OS's reason, no partial file left).
    """
    say = say or (lambda line, *names: log(line))
    work = cfg.work_path()
    cache = work / f"data-{data_key(cfg, target_dir, mask_token_id)}.pt"
    blob = _load_data_cache(cache, log) if cache.is_file() else None
    written = blob is None  # (this run writes the cache)
    if blob is not None:
        log(f"data: loaded {cache}")
        for line in blob["notes"]:  # (what the run that made it said about the data; a line alone in older caches)
            say(*line) if isinstance(line, (list, tuple)) else log(line)
    else:
        blob = _tokenize_data(cfg, target_dir, tokenizer, say, mask_token_id)
        tmp = cache.with_suffix(".tmp")
        try:  # (a full disk: torch.save's RuntimeError "unexpected pos ..." was a traceback, trial-293 b)
            work.mkdir(parents=True, exist_ok=True)
            torch.save(blob, tmp)
            _fsync(tmp)  # (on the disk before its name is, as the export's files)
            os.replace(tmp, cache)
        except (OSError, RuntimeError) as exc:
            reason = write_error_reason(exc, tmp, cache)
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise DFlashError(f"cannot save the prepared data to {quoted(cache)}: {reason}") from None
        except BaseException:  # (a Ctrl-C: no half-written file left behind)
            with suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
    stream = blob["stream"]
    chat = [Example(i, m) for i, m in blob["chat"]]
    distilled = [Example(i, m) for i, m in blob["distilled"]]
    stats = blob["stats"]
    try:
        check_data_size(cfg, stream.numel(), len(chat), len(distilled),
                        no_turn=stats["conversations_without_assistant_turn"],
                        past_seq_len=stats["conversations_reply_past_seq_len"])
    except DFlashError:
        if written:  # (this run's cache of data too small to train on: nothing to keep)
            cache.unlink(missing_ok=True)
        raise
    if written:  # (only now that this run trains on the new cache: a refused run keeps the older ones)
        for old in sorted(work.glob("data-*")):
            if old != cache and re.fullmatch(r"data-[0-9a-f]{16}\.(pt|tmp)", old.name):
                held = _distilled_in(old)
                if held:  # (hours of generation, lost to one try of other settings: trial-272)
                    log(f"data: kept {old} (made from other data or settings, but it holds {held} self-distilled "
                        "sequences, costly to make again: a run with its data and settings loads it; delete it to free "
                        "its space)")
                    continue
                old.unlink()
                log(f"data: removed {old} (made from other data or settings)")
    kind, counts = eval_kind(cfg, stream, chat, distilled)
    stream, chat, distilled, val_rows, copies = split_eval(cfg, stream, chat, distilled)
    if cfg.val_seqs and len(val_rows) < cfg.val_seqs:  # (split_eval's caps; it said so only in the log's stats)
        whole = {"distilled": f"the {counts[kind]} self-distilled sequences", "chat": f"the {counts[kind]} chat "
                 f"conversations", "text": f"the {counts[kind]} windows of the text"}[kind]
        say(f"data: holding out {len(val_rows)} sequence{'' if len(val_rows) == 1 else 's'} for evaluation, not val_seqs "
            f"{cfg.val_seqs}: they are taken from one kind of data only, here {whole}, at most a "
            f"{'tenth' if kind == 'text' else 'fifth'} of them, leaving at least batch {cfg.batch} sequences to train on"
            + (f", and none of the {copies} whose tokens another sequence repeats or begins with (they train)"
               if copies else ""),
            "val_seqs", "batch")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    data = TrainingData(stream, chat + distilled, cfg.seq_len, pad, cfg.raw_fraction)
    stats = dict(blob["stats"], val_sequences=len(val_rows), val_kind=kind if val_rows else None,
                 val_copies_left_to_train=copies, chat_and_distilled_examples=len(chat) + len(distilled))
    return data, val_rows, stats


class Trainer:
    """One training run; :meth:`run` trains and exports, returning the training log dict."""

    def __init__(self, cfg: TrainConfig, log=None, flags: dict[str, str] | None = None):
        """``log``: called with each line the run says (default: printed to stderr); ``flags``:
        the command line's flag of each field (``{"num_layers": "--num-layers"}``), by which
        lines that name fields name them (:meth:`say`; errors: the command line's own)."""
        self.cfg = cfg
        self.log = log or _say_line
        self.flags = flags or {}

    def say(self, line: str, *names: str) -> None:
        """Log ``line``, which names the fields ``names``: as the command line's flags where
        :attr:`flags` has them (as :func:`~dflash_torch.cli.error_message` names an error's)."""
        from ..cli import error_message

        self.log(error_message(named(line, *names), self.flags) if self.flags and names else line)

    def _model_dir(self, field: str) -> Path:
        """The directory of the model the field ``field`` (``target``, ``init_from``) names: the
        one :func:`check_run_dirs` resolved for this run, or its error raised as
        :func:`~dflash_torch.checkpoint.checkpoint_dir` raises it (a Hub id that could not be fetched
        was fetched again, "downloading ..." said twice: trial-293); else resolved now.

        Raises:
            OptionError: the model cannot be resolved, the message led by ``field``.
        """
        found = getattr(self, "_resolved", {}).get(field)
        if isinstance(found, OptionError):
            raise found
        if isinstance(found, DFlashError):
            raise OptionError(f"{field}: {found}", field) from None
        return found if found is not None else checkpoint_dir(getattr(self.cfg, field), field)

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.cfg.autocast else nullcontext()

    @torch.no_grad()
    def evaluate(self, drafter, target, rows, gamma, walk_rows: int = 16) -> dict:
        """Validation loss and slot accuracy on fixed random anchors, and the acceptance
        length of greedy decoding replayed on the first ``walk_rows`` rows (exact for
        self-distilled rows, a lower bound on other text: see :func:`greedy_walk`); where
        no row holds a block to replay (``val_tau`` None), ``val_tau_note`` says why, and what
        would give an estimate (its fields: :data:`VAL_TAU_NOTE_FIELDS`).
        ``val_slot_acc[k]``: the accuracy of draft slot ``k`` over the anchors where it was
        measured, None where it never was (no anchor with a label there)."""
        if not rows:
            return {}
        cfg = self.cfg
        drafter.eval()
        ce, w, sel, sel_w = 0.0, 0.0, 0.0, 0.0
        slot_c = slot_n = None
        gen = torch.Generator().manual_seed(12345)
        taus: list[int] = []
        for s in range(0, len(rows), cfg.batch):
            batch = collate(rows[s:s + cfg.batch], cfg.seq_len, 0)
            anchors, valid = sample_anchors(batch.lengths, batch.loss_mask, cfg.anchors_per_seq, gen)
            with self._autocast():
                out = batch_loss(drafter, target, batch.ids, batch.lengths, batch.loss_mask, anchors, valid, gamma)
            ce += out.ce_sum
            w += out.weight_sum
            if out.selector_loss is not None:
                sel, sel_w = sel + out.selector_loss * out.selector_weight_sum, sel_w + out.selector_weight_sum
            slot_c = out.slot_correct if slot_c is None else slot_c + out.slot_correct
            slot_n = out.slot_count if slot_n is None else slot_n + out.slot_count
        for ids, mask in rows[:walk_rows]:
            ids, mask = ids[:cfg.seq_len], mask[:cfg.seq_len]
            if mask.any():  # decoding starts at the first position with loss (the prompt's end)
                with self._autocast():
                    taus += greedy_walk(drafter, target, ids, max(int(mask.float().argmax()), 1))
        drafter.train()
        result = {"val_loss": round(ce / max(w, 1e-9), 4),
                  "val_tau": round(sum(taus) / len(taus), 3) if taus else None,
                  "val_slot_acc": [round(float(c) / int(n), 3) if n else None for c, n in zip(slot_c, slot_n)]}
        if not taus:  # (it was None with no word why)
            which = f"none of the first {walk_rows} held-out rows" if len(rows) > walk_rows else "no held-out row"
            B = drafter.config.block_size
            # (it said why, not what would give one: trial-320; self-distilled rows are held out first where there are 5,
            # split_eval, and a text prompt's continuation runs to seq_len)
            distill = "" if cfg.self_distill >= 5 else ("self_distill 5 or more (the held-out rows are then "
                                                         "self-distilled sequences, a text prompt's continued to "
                                                         "seq_len), or ")
            # (init_from's drafter fixes block_size: a smaller one is refused there, trial-325)
            smaller = "" if cfg.init_from is not None else ", or a smaller block_size"
            result["val_tau_note"] = (f"{which} holds a block of {B} tokens from its first position with loss (a "
                                      "reply's start) on before the row ends (at its last token or at seq_len "
                                      f"{cfg.seq_len}): nothing to replay; for an estimate, give {distill}data whose "
                                      f"replies run to {B} tokens or more within seq_len{smaller}")
        if drafter.config.dflash2 is not None:  # weighted by the slots that count (None where none did)
            result["val_selector_loss"] = round(sel / sel_w, 4) if sel_w else None
        return result

    def run(self) -> dict:
        """Train and export: returns the training log dict (what ``out/training_log.json`` holds).

        First the settings are checked (:func:`check_config`) and the directories
        (:func:`check_run_dirs`, which makes ``out`` and the work dir), before the target loads;
        a run that fails or is interrupted removes the directories it made that are still
        empty. ``torch``'s thread count (``num_threads``) is restored when it ends; the global
        ``random`` and ``torch`` generators are seeded with ``seed`` as the run begins and again
        right before the drafter's initialisation, which draws from them (so the drafter does
        not depend on what the data preparation drew: self-distillation, or a data cache read
        instead); the batches and anchors come from generators of their own (``(seed, step)``).

        Ctrl-C (``KeyboardInterrupt``) before training begins says so in a line; during
        training it saves a resumable checkpoint first (``resume=True`` continues it; a second
        Ctrl-C while it is saved is ignored). Either way ``KeyboardInterrupt`` is raised again
        (the command line exits 130). SIGTERM saving a checkpoint as Ctrl-C does is the command
        line's (``dflash-torch train`` exits 143 then): in Python a SIGTERM ends the process as
        its handler says, by default at once, without saving (a call made in the main thread
        inside :func:`dflash_torch.cli.terminate_as_interrupt` saves as on Ctrl-C, and the
        block then ends in ``SystemExit(143)``).

        A checkpoint that cannot be saved (a ``ckpt_every`` one, which stops training, the last
        one, or a Ctrl-C's) leaves the drafter of its step exported to ``out``, then is said:
        DFlashError, or after a Ctrl-C a line and ``KeyboardInterrupt``.

        Raises:
            OptionError: a setting or directory refused (see :func:`check_config` and
                :func:`check_run_dirs`), naming its field; an ``out`` or work dir another run
                is using (a run holds them locked until it ends: :class:`~.runlock.RunLock`);
                also later ones (a ``mask_token_id`` outside the target's vocabulary, too
                little data for one step of ``batch``).
            DFlashError: a target, drafter, data file or checkpoint that cannot be used,
                training that diverged, files that cannot be written.
            KeyboardInterrupt: Ctrl-C, once what was trained is saved.
        """
        cfg = self.cfg
        cfg.__post_init__()  # (fields set after it was made: a Path, a torch.dtype)
        check_config(cfg)  # (the command line's checks, shared)
        # the directories this run makes (check_run_dirs makes them): a run that stops removes those still empty, deepest
        # first (one refused for too little data removes its data cache first: prepare_data); never a file, which
        # may be another run's written meanwhile into a directory this one made (a shared new parent or work dir)
        made = sorted(set(missing_dirs(cfg.work_path())) | set(missing_dirs(Path(cfg.out))),
                      key=lambda p: len(p.parts), reverse=True)
        threads = torch.get_num_threads()
        self._interrupt_note = "while preparing the data: no step was trained"  # (None once training begins)
        dirs = {"out": (cfg.out, Path(cfg.out)), "work_dir": (cfg.work_dir or str(cfg.work_path()), cfg.work_path())}
        lock = RunLock()  # (two runs in one directory at once: each wrote over the other's checkpoint and drafter)
        try:
            lock.take(dirs, existing=True)  # (another run's first: not said as the checkpoint or drafter it writes)
            self._resolved = {}  # (the models check_run_dirs resolved, for the load: a Hub id fetched once)
            check_run_dirs(cfg, self._resolved)
            lock.take(dirs)
            return self._run()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and self._interrupt_note is not None:
                self.say(f"interrupted {self._interrupt_note}", "resume")
            lock.release()  # (its files out of the directories it made, which are then removed)
            for path in made:  # (the deepest first)
                with suppress(OSError):
                    path.rmdir()
            raise
        finally:  # (num_threads set it for the process: the caller's count stayed 1)
            lock.release()
            torch.set_num_threads(threads)

    def _run(self) -> dict:
        cfg = self.cfg
        t_start = time.time()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        seed_generators(cfg.seed)
        # (a missing or unreadable --data path: an error before the target loads, not after its log lines)
        for file, _ in corpus_files(cfg.data, cfg.own_dirs()):
            try:
                open(file, "rb").close()
            except OSError as exc:
                raise DFlashError(f"cannot read {file}: {exc.strerror or exc}") from None
        ckpt_path = cfg.work_path() / CHECKPOINT
        if cfg.resume and not ckpt_path.is_file():  # (it was found out after the data was prepared)
            raise OptionError(f"resume=True: no checkpoint at {quoted(ckpt_path)}", "resume")
        target_dir = self._model_dir("target")
        target_revision = hub.revision_of(target_dir)
        init_from_revision = None if cfg.init_from is None else hub.revision_of(cfg.init_from)
        target_cfg = TargetConfig.from_dict(load_config(target_dir))
        if cfg.seq_len > (limit := context_limit(target_cfg)):
            raise OptionError(f"seq_len {cfg.seq_len} exceeds the target's context of {limit} tokens", "seq_len")
        tokenizer = load_tokenizer(target_dir, target_cfg.vocab_size, "target")
        if cfg.chat_template_kwargs is not None:  # (before the target loads)
            check_chat_template_kwargs(cfg.chat_template_kwargs, reserved_template_variables(tokenizer),
                                       "chat_template_kwargs")
            if not getattr(tokenizer, "chat_template", None):
                raise OptionError("chat_template_kwargs apply to chat ('messages') data, which needs a target "
                                  "tokenizer with a chat template; this one has none", "chat_template_kwargs")
        try:  # (train holds the target in float32 on the CPU: check_fits refuses one that cannot fit, in one line)
            target = TargetModel.from_pretrained(target_dir, torch.float32, parsed=target_cfg)
        except DFlashError as exc:
            if str(exc).startswith("the target needs "):
                raise DFlashError(f"{exc} (train loads the target in float32 on the CPU, about 4 bytes a parameter; "
                                  "the drafter and its optimizer need more beyond it)") from None
            raise
        target.requires_grad_(False)
        st, was_init = None, None
        # (before the data is prepared, which can take long, and before the drafter config is made: the checkpoint
        # names the mask token, and the --init-from, of its run)
        if cfg.resume:
            try:  # (one this process may not read; mapping a damaged one fails with OSErrors too)
                open(ckpt_path, "rb").close()
            except OSError as exc:
                raise OptionError(f"resume=True: cannot read {quoted(ckpt_path)}: {exc.strerror or exc}", "resume") from None
            try:  # (mapped: its tensors are read when the drafter and optimizer take them, after the data step)
                st = torch.load(ckpt_path, weights_only=True, mmap=True)  # (a pickle of other objects could run code)
            except pickle.UnpicklingError:  # (weights_only's refusal of an object that is no tensor or plain value)
                raise named(f"resume=True: {quoted(ckpt_path)} holds Python objects a dflash-torch training checkpoint does "
                            "not (only tensors and plain values), so it is not read (unpickling them could run "
                            "code); give the work_dir of a dflash-torch train run, or leave out resume=True and "
                            "pass overwrite=True to replace it", "resume", "work_dir", "overwrite") from None
            except Exception:  # (torch's words, cut short, were about zip archives or torch.save's mmap option: trial-175)
                raise named(f"resume=True: {quoted(ckpt_path)} is not a whole torch checkpoint file (truncated or damaged), "
                            "so it cannot be read; leave out resume=True and pass overwrite=True to start over",
                            "resume", "overwrite") from None
            missing = [k for k in CHECKPOINT_KEYS if k not in st] if isinstance(st, dict) else list(CHECKPOINT_KEYS)
            if missing:  # (another tool's checkpoint.pt: it was a KeyError traceback)
                raise named(f"resume=True: {quoted(ckpt_path)} is not a dflash-torch training checkpoint (it holds no "
                            f"{', '.join(missing)}); give the work_dir of a dflash-torch train run, or leave "
                            "out resume=True and pass overwrite=True to replace it", "resume", "work_dir", "overwrite")
            was_init = (st.get("train_config") or {}).get("init_from")
        source, notes, taken = None, [], {}
        if cfg.init_from:
            source, dcfg = load_init_drafter(cfg, target_cfg, tokenizer, self._model_dir("init_from"))
            how = f"from init_from {quoted(cfg.init_from)}"
        else:
            # (a run that started from an init_from drafter, resumed without it: the shape settings not given are the
            # checkpoint's, which that drafter set; the defaults were compared and "pass init_from again" advised, which
            # led nowhere where that drafter had changed since, trial-293)
            taken = checkpoint_shape(cfg, st["drafter_config"]) if st is not None and was_init else {}
            if "mask_token_id" in taken:
                mask_id, how = taken["mask_token_id"], f"the checkpoint's, of its run's init_from {quoted(was_init)}"
            else:
                try:
                    mask_id, how = resolve_mask_token_id(tokenizer, target_cfg.vocab_size, cfg.mask_token_id)
                except DFlashError:  # (--resume: the checkpoint's; the comparison below says first if it is another target's)
                    kept = (st["drafter_config"].get("dflash_config") or {}).get("mask_token_id") \
                        if st is not None and cfg.mask_token_id is None else None
                    if not isinstance(kept, int):
                        raise
                    mask_id, how = kept, "the checkpoint's"
            used = {getattr(tokenizer, f"{k}_token_id", None): k for k in ("pad", "bos", "eos")}
            if how == "given" and mask_id in used:  # (the data holds it: a masked slot looks like that token)
                self.say(f"WARNING: mask_token_id {mask_id} is the tokenizer's {used[mask_id].upper()} token, which "
                         "the training data holds; the drafter cannot tell a masked slot from it (give an id the data "
                         "never uses, or leave the option out)", "mask_token_id")
            elif how == "given" and mask_id in token_ids(tokenizer) and mask_id not in tokenizer.all_special_ids \
                    and mask_id not in tokenizer.added_tokens_decoder:  # (trial-229: a plain word's id, taken silently)
                free = unused_token_id(tokenizer, target_cfg.vocab_size)
                self.say(f"WARNING: mask_token_id {mask_id} is the tokenizer's token "
                         f"{tokenizer.convert_ids_to_tokens(mask_id)!r}, which text is tokenized to; the drafter cannot "
                         "tell a masked slot from it (give an id no text maps to"
                         + (f", e.g. {free}, the first embedding row that is no token" if free is not None else "")
                         + ", or leave the option out)", "mask_token_id")
            dcfg = make_drafter_config(target_cfg, replace(cfg, **taken), mask_id, warn=notes.append)
        if cfg.seq_len <= dcfg.block_size:
            raise OptionError(f"seq_len ({cfg.seq_len}) must be longer than the block size ({dcfg.block_size})", "seq_len")
        if cfg.resume:
            derived = {}  # (the settings whose flags were not given: named by where their values came from)
            if cfg.target_layer_ids is None:
                derived["target_layer_ids"] = ("target layers", f"the default of num_layers {cfg.num_layers}; "
                                               "target_layer_ids not given")
            if cfg.intermediate_size is None:
                derived["intermediate_size"] = ("MLP width", "the target's; intermediate_size not given")
            if cfg.mask_token_id is None:
                derived["mask_token_id"] = ("mask token id", f"{how}; mask_token_id not given")
            # (the shape is the init_from drafter's where one is given, named by its keys; one taken from the checkpoint
            # equals it, and a shape setting given besides is the user's, named as its field)
            shaped = bool(cfg.init_from)
            differ = drafter_config_differences(dcfg.to_dict(), st["drafter_config"], shaped, derived)
            names = ["resume", "overwrite", "init_from", *differences_names(differ, shaped, derived)]
            # (the fields, which the command line names as flags: they named the flags in Python too, trial-259)
            tail = "or leave out resume=True and pass overwrite=True to start over"
            same_target = st.get("target_dir") in (None, str(target_dir.resolve()))
            given = [DRAFTER_FLAGS[key] for key in differ if key in DRAFTER_FLAGS]
            if differ and was_init and not cfg.init_from and len(given) == len(differ) and "arch" not in given:
                # (settings given that the checkpoint's shape, its init_from drafter's, does not have: it said "pass
                # init_from again", which led nowhere where that drafter had changed since: trial-293)
                raise named(f"resume=True: {quoted(ckpt_path)} was trained with another drafter configuration: "
                            f"{'; '.join(differ.values())}: its run started with init_from {quoted(was_init)}, which "
                            f"set the drafter's shape, and a run resumed without init_from takes its shape from the "
                            f"checkpoint: leave out {', '.join(dict.fromkeys(given))} to continue it, {tail}", *names,
                            *dict.fromkeys(given))  # (named twice: the flag in "leave out" too)
            if differ and was_init and not cfg.init_from and same_target:  # (its other settings, e.g. its
                # max_position_embeddings, came from that drafter too: only it gives them)
                raise named(f"resume=True: {quoted(ckpt_path)} was trained with another drafter configuration: "
                            f"{'; '.join(differ.values())}: its run started with init_from {quoted(was_init)}, which "
                            f"set it; pass init_from {quoted(was_init)} again to continue it, {tail}", *names)
            from_target = [text for key, text in differ.items() if key not in DRAFTER_FLAGS]
            if from_target:  # (the target's sizes: no flag gives them, nor the settings left to follow the target)
                left = {"target_layer_ids": cfg.target_layer_ids, "intermediate_size": cfg.intermediate_size,
                        "mask_token_id": cfg.mask_token_id}
                flags = [text for key, text in differ.items() if key in DRAFTER_FLAGS and not (
                    key in left and left[key] is None) and not ((cfg.init_from or was_init) and key in SHAPE_KEYS)]
                was = st.get("target_dir")
                also = f"; and other settings: {'; '.join(flags)}" if flags else ""
                # (the field target is named once, where it is to be passed: "another model", not "another target";
                # it said "pass --target" in Python too: trial-263)
                raise named(f"resume=True: {quoted(ckpt_path)} was trained for another model"
                            f"{f', {quoted(was)}' if was else ''} ({'; '.join(from_target)}{also}): pass "
                            f"{f'target {quoted(was)}' if was else 'the target it was trained for'}"
                            f"{' and the values of the checkpoint' if flags else ''} to continue it, {tail}",
                            *names, "target")
            shape_only = all(key in SHAPE_KEYS or key in DFLASH2_SIZES for key in differ)
            leave_out = ("leave out init_from to continue it (a run resumed without it takes the drafter's shape from the "
                         f"checkpoint), {tail}")
            if differ and cfg.init_from and not same_init_source(was_init, cfg.init_from):  # (its values came from
                # a drafter the run did not start from: "give the checkpoint's values" named no flag that sets them)
                if was_init and shape_only:
                    how = leave_out
                elif was_init:
                    how = f"pass init_from {quoted(was_init)} instead to continue it, {tail}"
                else:
                    how = f"leave out init_from and give the checkpoint's values to continue it, {tail}"
                raise named(f"resume=True: {quoted(ckpt_path)} was trained with another drafter configuration: "
                            f"{'; '.join(differ.values())}: here they are those of init_from {quoted(cfg.init_from)}, "
                            f"which its run did not start from ({how})", *names)
            if differ and cfg.init_from and shape_only:  # (the same init_from, changed since the run started from it: it
                # said "give the checkpoint's values", which the shape settings refused beside init_from: trial-293)
                raise named(f"resume=True: {quoted(ckpt_path)} was trained with another drafter configuration: "
                            f"{'; '.join(differ.values())}: here they are those of init_from {quoted(cfg.init_from)}, "
                            f"which has changed since its run started from it ({leave_out})", *names)
            if differ:
                raise named(f"resume=True: {quoted(ckpt_path)} was trained with another drafter configuration: "
                            f"{'; '.join(differ.values())} (give the checkpoint's values to continue it, {tail})",
                            *names)
        # (before the data is prepared: a drafter too big failed with an allocator's traceback once it was built)
        check_drafter_fits(dcfg, cfg)
        gamma = default_gamma(dcfg.block_size) if cfg.gamma is None else cfg.gamma
        extra = f", DFlash 2 modules {dcfg.dflash2}" if dcfg.dflash2 else ""
        self.say(f"drafter: {dcfg.num_hidden_layers} layers, B={dcfg.block_size}, target_layer_ids={dcfg.target_layer_ids}, "
                 f"mask_token_id={dcfg.mask_token_id} ({how}), gamma={gamma:g}{extra}",
                 *(["init_from"] if cfg.init_from or "mask_token_id" in taken else []))  # (how: "... init_from '...'")
        for note in notes:  # (the default target layers' warning)
            self.say(note, "target_layer_ids", "num_layers")
        recorded = asdict(cfg)  # (the settings the checkpoint and training_log.json record)
        if cfg.init_from or taken:  # (the sizes it took from that drafter, or the checkpoint: it recorded the fields'
            # defaults, trial-259)
            recorded.update(num_layers=dcfg.num_hidden_layers, block_size=dcfg.block_size)
            if dcfg.dflash2 is not None:
                recorded.update({k: getattr(dcfg.dflash2, k) for k in DFLASH2_SIZES})
        if st is not None:  # (said before the data step too)
            step, elapsed_prev = st["step"], st["elapsed"]
            self.log(f"resume: step {step}, {elapsed_prev / 60:.1f} min trained")
            before = st.get("train_config") or {}
            keys = [k for k in RECIPE if k in before and before[k] != getattr(cfg, k)]
            changed = [recipe_change(k, getattr(cfg, k), before[k], dcfg.block_size, cli=bool(self.flags)) for k in keys]
            changed_names = [k for k in keys if k != "autocast"]  # (recipe_change names autocast's flag itself)
            if st.get("target_dir") not in (None, str(target_dir.resolve())):  # (another target, however it is spelt)
                typed = before.get("target")  # (named as typed; resolved where the same words name another one)
                now, was = (cfg.target, typed) if typed not in (None, cfg.target) else (str(target_dir.resolve()),
                                                                                       st["target_dir"])
                changed.insert(0, f"target {now!r} (was {was!r})")
                changed_names.insert(0, "target")
            reached = cfg.steps is not None and step >= cfg.steps
            spent = cfg.time_budget_min is not None and elapsed_prev >= cfg.time_budget_min * 60
            if reached:
                self.say(f"resume: the checkpoint is at step {step}, steps {cfg.steps} is reached: no training; "
                         "the drafter is exported as it is (give a larger steps to train on)", "steps")
            elif spent:
                self.say(f"resume: the checkpoint has trained {elapsed_prev / 60:.1f} min, time_budget_min "
                         f"{cfg.time_budget_min:g} is spent: no training; the drafter is exported as it is",
                         "time_budget_min")
            if reached or spent:  # (no step is trained: the recipe stays the one the drafter was trained with; it was
                # rewritten with this run's, and warned as one "training goes on with": trial-175)
                recorded.update({k: before[k] for k in (*RECIPE, "steps", "time_budget_min") if k in before})
            elif changed:  # (allowed, e.g. on purpose; but then not the run an uninterrupted one would be)
                self.say(f"resume: WARNING: the recipe differs from the checkpoint's run: {', '.join(changed)}; "
                         "training goes on with the new values", *changed_names)
            was_target = before.get("init_from_target")
            if was_target is not None and was_target != cfg.init_from_target:  # (given or dropped: ignored, unsaid)
                self.say("resume: WARNING: init_from_target " + ("given (was not)" if cfg.init_from_target else
                         "left out (was given)") + ": it sets the weights a run starts from, and a resumed run goes on "
                         "from the checkpoint's; it changes nothing here", "init_from_target")
                recorded["init_from_target"] = was_target  # (the record says how the drafter started)
            if "init_from" in before:  # (given, changed or dropped: it was ignored unsaid, and recorded as the run's
                # start, a pair with init_from_target the flags refuse, which a later resume then named: trial-249)
                if not same_init_source(before["init_from"], cfg.init_from):
                    was = before["init_from"]
                    what = (f"{quoted(cfg.init_from)} given (was not)" if was is None else f"left out (was {quoted(was)})"
                            if cfg.init_from is None else f"{quoted(cfg.init_from)} (was {quoted(was)})")
                    self.say(f"resume: WARNING: init_from {what}: it sets the weights a run starts from, and a "
                             "resumed run goes on from the checkpoint's; it changes nothing here", "init_from")
                recorded["init_from"] = before["init_from"]  # (the run's first value: never rewritten by a resume)
        # (quoted as a shell reads it: an --out with a space was recorded unquoted, trial-284)
        command = shlex.join(["dflash-torch", *sys.argv[1:]]) if sys.argv[1:2] == ["train"] else None
        runs = invocations(st, command, recorded)

        data, val_rows, data_stats = prepare_data(cfg, target_dir, tokenizer, self.log, dcfg.mask_token_id,
                                                  say=self.say)
        self.log(data_line(data_stats))  # (the counts in full: training_log.json's data)
        # (--resume, the next step a Ctrl-C during training names, was tried, and refused: no checkpoint: trial-320)
        again = "continue" if cfg.resume else "start training (without resume=True: no checkpoint was saved)"
        self._interrupt_note = (f"before training began: no step was trained (the prepared data is kept in "
                                f"{quoted(cfg.work_path())}); run the same command again to {again}")

        # (seeded again where the initialisation draws from them: what ran since the seeding above may have drawn too,
        # transformers loading a Qwen3.5 target to self-distill does, which only a run without the data cache runs; the
        # same seed trained another drafter with the cache than without it: trial-320)
        seed_generators(cfg.seed)
        drafter = drafter_class(dcfg)(dcfg)
        drafter.rotary = drafter.make_rotary(dcfg)
        init_drafter_weights(drafter)
        if cfg.init_from_target:
            copied = copy_target_layers(drafter, target)
            if st is None:  # (a resumed run takes the checkpoint's weights instead)
                self.say(init_from_target_note(copied), "init_from_target")
        if source is not None and st is None:  # (a resumed run takes the checkpoint's weights: it said "init: weights
            # of" the --init-from drafter after "resume: step N", as if they were reset to them: trial-175)
            fresh = copy_drafter(drafter, source)
            self.log(f"init: weights of {cfg.init_from}" + (f"; new: {len(fresh)} tensors of the DFlash 2 modules" if fresh else ""))
        del source
        drafter.train()
        n_params = sum(p.numel() for p in drafter.parameters())
        decay = [p for p in drafter.parameters() if p.dim() >= 2]
        no_decay = [p for p in drafter.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

        cfg.work_path().mkdir(parents=True, exist_ok=True)
        step, elapsed_prev, history, evals = 0, 0.0, [], []
        warm_elapsed = 0.0 if not cfg.warmup_steps else None  # (the time trained when the warm-up ended)
        decay_from = "warmup"  # (where the lr's cosine decay counts from: "start", step 0, for an old checkpoint's run)
        loss_acc, n_acc = 0.0, 0  # (the sum and count of the losses behind the next loss_history row)
        if st is not None:
            drafter.load_state_dict(st["drafter"])
            opt.load_state_dict(st["optimizer"])
            step, elapsed_prev, history, evals = st["step"], st["elapsed"], st["history"], st["evals"]
            loss_acc, n_acc = st.get("loss_acc", 0.0), st.get("n_acc", 0)  # (a checkpoint saved before they were: 0)
            # (a checkpoint saved before the decay was counted from the warm-up's end, which has no lr_decay_from nor
            # warmup_elapsed: its run keeps the schedule it began with, its decay counted from step 0 in steps and in
            # time; it went on with the new one, the lr jumping back up: trial-263)
            decay_from = st.get("lr_decay_from") or ("warmup" if "warmup_elapsed" in st else "start")
            warm_elapsed = 0.0 if decay_from == "start" else st.get("warmup_elapsed")
            if decay_from == "start":
                self.log("resume: the checkpoint's run decays the learning rate from step 0 (it was saved before the "
                         "decay was counted from the end of the warm-up), and keeps doing so")
            del st  # (its tensors now live in the drafter and the optimizer)

        budget = cfg.time_budget_min * 60 if cfg.time_budget_min is not None else None
        t_train = time.time()

        def elapsed() -> float:
            return elapsed_prev + time.time() - t_train

        def progress() -> float:
            """The share of the lr's decay done (:func:`lr_at`): counted from the end of the warm-up (from step 0
            for the run of a checkpoint saved before that), in steps (of steps) and in time (of time_budget_min),
            whichever is further."""
            p = 0.0
            warmup = cfg.warmup_steps if decay_from == "warmup" else 0
            if cfg.steps:
                p = (step - warmup) / max(cfg.steps - warmup, 1)
            if budget and warm_elapsed is not None:
                p = max(p, (elapsed() - warm_elapsed) / max(budget - warm_elapsed, 1e-9))
            return p

        def check_finite() -> None:
            if not all(all_finite(p.detach()) for p in drafter.parameters()):  # (an update, e.g. a huge --lr, made them so)
                raise OptionError(f"training diverged by step {step}: the drafter's weights hold NaN or infinite "
                                  f"values; lower lr (now {cfg.lr:g})", "lr")

        def save_checkpoint() -> DFlashError | None:
            """Save the checkpoint of ``step`` (its weights checked first: DFlashError where they diverged);
            the error that says why it could not be saved (the checkpoint before it, if any, stays), else None."""
            nonlocal saved_step
            check_finite()
            tmp = ckpt_path.with_suffix(".tmp")
            try:  # (torch.save says a full disk as a RuntimeError: "unexpected pos ...")
                torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
                            "target_dir": str(target_dir.resolve()),
                            "elapsed": elapsed(), "history": history, "evals": evals,
                            "loss_acc": loss_acc, "n_acc": n_acc,  # (the steps since the last loss_history row)
                            "warmup_elapsed": warm_elapsed, "lr_decay_from": decay_from,
                            "drafter_config": dcfg.to_dict(), "train_config": recorded, "runs": runs}, tmp)
                _fsync(tmp)  # (a power cut after the rename would leave --resume an empty checkpoint)
                os.replace(tmp, ckpt_path)
            except (OSError, RuntimeError) as exc:
                reason = write_error_reason(exc, tmp, ckpt_path)
                if tmp.is_file():
                    tmp.unlink()
                return DFlashError(f"cannot save the training checkpoint of step {step} to {quoted(ckpt_path)}: {reason}")
            saved_step = step
            return None

        def kept_note() -> str:
            """After a checkpoint that could not be saved: "; the checkpoint of step N stays in ``ckpt_path``, and
            resume=True continues from it", where it holds this run's last one (saved, or resumed from), else ""
            (said through :func:`named` with the field resume: --resume on the command line)."""
            if saved_step is None or not ckpt_path.is_file():
                return ""
            return f"; the checkpoint of step {saved_step} stays in {quoted(ckpt_path)}, and resume=True continues from it"

        def unsaved_line(unsaved: DFlashError) -> str:
            """``unsaved`` (why the checkpoint of ``step`` could not be saved), with what resume=True does then."""
            note = kept_note()
            return f"{unsaved}{note}" if note else f"resume=True cannot continue this run: {unsaved}"

        def export(unsaved: DFlashError | None) -> tuple[Path, dict]:
            """Export the drafter of ``step`` to --out with its training_log.json: its directory and
            the log. ``unsaved``: why the checkpoint of this step could not be saved, if so (said too
            where the export fails: DFlashError)."""
            info = {
                "command": command,  # (this invocation's, as config: each one's is in runs)
                # (the commit of a Hub id's snapshot, ORG/NAME@main's too: main moves; null for a local directory)
                "target_revision": target_revision, "init_from_revision": init_from_revision,
                "config": recorded, "drafter_config": exported_config(dcfg, cfg.save_dtype),
                "mask_token_id_source": how, "gamma": gamma,
                "params": n_params, "steps": step, "train_time_s": round(elapsed(), 1),
                "wall_time_s": round(time.time() - t_start, 1), "data": data_stats,
                "final_train_loss": history[-1]["loss"] if history else None,
                "final_eval": evals[-1] if evals else None, "eval_history": evals, "loss_history": history,
                "runs": runs, "torch_version": torch.__version__,
            }
            try:
                out_dir = export_drafter(drafter, dcfg, Path(cfg.out), cfg.save_dtype, self.log)
            except (OSError, SafetensorError) as exc:  # (a full disk: --out keeps what it held)
                kept = f"the checkpoint of step {step} is saved in {quoted(ckpt_path)}: run again with resume=True to " \
                    "export it" if unsaved is None else f"and {unsaved}{kept_note()}"
                raise named(f"cannot export the drafter to {quoted(cfg.out)}: {write_error_reason(exc)}; {kept}",
                            "resume") from None
            try:
                _write_replacing(out_dir / "training_log.json", json.dumps(info, indent=2) + "\n")
            except OSError as exc:
                raise named(f"the drafter is saved in {quoted(out_dir)}, but its training_log.json could not be written: "
                            f"{exc.strerror or exc}" + (f"; and {unsaved}{kept_note()}" if unsaved else ""), "resume") from None
            return out_dir, info

        def log_row(out, at: float | None = None) -> dict:
            """The loss_history row of ``step``: the mean loss of the steps since the last row,
            ``train_tau`` (and a DFlash 2 drafter's ``selector_loss``) of ``out``, the step's batch; trained
            ``at`` seconds (default: now)."""
            row = {"step": step, "loss": round(loss_acc / n_acc, 4),
                   "train_tau": round(out.tau, 3) if out.accepted.numel() else None,
                   "lr": lr, "grad_norm": round(gnorm, 3), "elapsed_s": round(elapsed() if at is None else at, 1)}
            if drafter.config.dflash2 is not None:  # (null: no slot's label among its candidates)
                row["selector_loss"] = None if out.selector_loss is None else round(out.selector_loss, 4)
            return row

        if cfg.steps is not None and cfg.warmup_steps > cfg.steps > step:  # (steps=20 with the default 50: unsaid)
            self.say(f"WARNING: warmup_steps {cfg.warmup_steps} is more than steps {cfg.steps}: the learning rate warms "
                     f"up for the whole run, reaching {cfg.steps / cfg.warmup_steps:.2g} x lr at its last step, and "
                     "never decays; give a smaller warmup_steps", "warmup_steps", "steps", "lr")
        from tqdm import tqdm

        # (no bar where stderr is not a terminal, disable=None: its \r-separated redraws filled a log file, trial-284)
        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", disable=None if cfg.progress else True,
                   dynamic_ncols=True)
        out = None  # (the last step's, once one is trained)

        def evaluate_at(at: int, said: bool = True) -> dict:
            """The evaluation of the drafter as of step ``at`` on the held-out rows, added to
            ``evals`` and its line said (``said``) where it has a ``val_loss`` (none without rows)."""
            result = {"step": at, **self.evaluate(drafter, target, val_rows, gamma)}
            if result.get("val_loss") is not None:
                evals.append(result)
                if said:
                    noted = "val_tau_note" in result and not said_note
                    self.say(_eval_line(result, noted), *(VAL_TAU_NOTE_FIELDS if noted else []))
                    if noted:
                        said_note.append(at)
            return result

        said_note: list[int] = []  # (the step whose eval line said val_tau_note: the later ones refer to it)
        last_eval = evals[-1] if evals else {}
        if not evals:
            last_eval = evaluate_at(0)
        elif val_rows and step % cfg.eval_every == 0 and evals[-1]["step"] != step:
            # (a checkpoint saved before its step's evaluation was logged, e.g. on a Ctrl-C in it: that evaluation runs
            # first, so eval_history is the uninterrupted run's; it was lost for good: trial-272)
            last_eval = evaluate_at(step)
        first_step = step  # (one budget spent before this run trained a step is warned)
        # (where no bar is drawn, e.g. nohup's log file, a line every PROGRESS_LINE_EVERY_S: between the evaluations
        # such a log said nothing, no train loss, rate or time left, for many minutes: trial-320)
        lines_due = cfg.progress and bar.disable
        t_loop = last_line = time.time()
        tokens = 0  # (the tokens of this invocation's steps' batches)
        self._interrupt_note = None
        unsaved = None  # (why a checkpoint could not be saved: training stops, the drafter is exported, then it is said)
        saved_step = step if cfg.resume else None  # (the step of this run's checkpoint that ckpt_path holds: resumed)
        try:
            while (cfg.steps is None or step < cfg.steps) and (budget is None or elapsed() < budget):
                if warm_elapsed is None and step >= cfg.warmup_steps:
                    warm_elapsed = elapsed()
                lr = lr_at(step, progress(), cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                gen = step_generator(cfg.seed, step)
                batch = data.sample(cfg.batch, gen)
                anchors, valid = sample_anchors(batch.lengths, batch.loss_mask, cfg.anchors_per_seq, gen)
                # (the --steps run's last step is logged too: its row, like the others, has the step's train_tau)
                logging = (step + 1) % cfg.log_every == 0 or step == 0 or step + 1 == cfg.steps
                with self._autocast():
                    out = batch_loss(drafter, target, batch.ids, batch.lengths, batch.loss_mask, anchors, valid, gamma,
                                     stats=logging, selector_weight=cfg.selector_loss_weight)
                objective = float(out.loss.detach())
                # the logged loss is the cross-entropy, as val_loss (a DFlash 2 objective adds the selector loss,
                # logged beside it as selector_loss)
                loss = objective if out.selector_loss is None else out.ce_sum / max(out.weight_sum, 1e-9)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()
                gnorm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
                if not (math.isfinite(objective) and math.isfinite(gnorm)):  # before the update spreads it to the weights
                    raise OptionError(f"training diverged at step {step + 1} (loss {objective:.4g}, gradient norm "
                                      f"{gnorm:.4g}); lower lr (now {cfg.lr:g})", "lr")
                with deferred_interrupt():  # (a Ctrl-C here would save a half-applied update)
                    try:
                        opt.step()
                    except RuntimeError as exc:  # (e.g. Adam's update overflowing a float at a huge --lr)
                        raise named(f"training diverged at step {step + 1}: the optimizer step failed "
                                    f"({' '.join(str(exc).split())[:120]}); lower lr (now {cfg.lr:g})", "lr") from None
                    step += 1
                    loss_acc += loss  # (with the step: a Ctrl-C after it saves them as it does the step)
                    n_acc += 1
                    if logging:
                        history.append(log_row(out))
                        loss_acc, n_acc = 0.0, 0
                if step % cfg.eval_every == 0 and val_rows:
                    last_eval = evaluate_at(step)
                if step % cfg.ckpt_every == 0:
                    unsaved = save_checkpoint()
                    if unsaved is not None:
                        break
                # (the last loss_history row's loss, as the log says it: a moving average of its own lagged behind it,
                # 6.817 on the bar at the end of a run whose log said 5.5254: trial-272)
                post = {"loss": str(history[-1]["loss"]) if history else "-", "lr": f"{lr:.1e}"}
                if last_eval.get("val_tau") is not None:
                    post["val_tau"] = f"{last_eval['val_tau']:.2f}"
                if budget:
                    post["min"] = f"{elapsed() / 60:.1f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
                tokens += int(batch.lengths.sum())
                if lines_due and time.time() - last_line >= PROGRESS_LINE_EVERY_S:
                    last_line = time.time()
                    # (this step's loss, a float already: the last loss_history row's was up to log_every - 1 steps
                    # old beside this step's lr, trial-325)
                    self.log(progress_line(step, cfg.steps, round(loss, 4), lr,
                                           step - first_step, tokens, last_line - t_loop, elapsed(), budget))
            bar.close()  # (a Ctrl-C in the last measurement or evaluation: as in training)
            if n_acc and out is not None:  # (a --time-budget-min stop after steps not yet logged: the last step did not measure its
                # train_tau, which is measured now on its batch, after its update; its selector_loss is its own)
                at = elapsed()
                with torch.no_grad(), self._autocast():
                    out.accepted = batch_loss(drafter, target, batch.ids, batch.lengths, batch.loss_mask, anchors, valid,
                                              gamma, selector_weight=cfg.selector_loss_weight).accepted
                history.append(log_row(out, at))
                loss_acc, n_acc = 0.0, 0
            if val_rows and (not evals or evals[-1]["step"] != step):
                last_eval = evaluate_at(step, said=False)
        except KeyboardInterrupt:  # Ctrl-C: keep what was trained
            bar.close()
            with ignored_interrupt():  # (a second Ctrl-C: the save goes on, whole)
                unsaved = save_checkpoint()
                if unsaved is not None:  # (e.g. a full work dir: the drafter is exported instead; still exit 130)
                    out_dir, _ = export(unsaved)
            if unsaved is not None:
                self.say(f"interrupted: the drafter of step {step} is saved in {quoted(out_dir)}, but "
                         f"{unsaved_line(unsaved)}", "resume")
            else:
                self.say(f"interrupted: checkpoint of step {step} saved to {quoted(ckpt_path)}; continue with resume=True", "resume")
            raise
        if step == first_step and budget is not None and elapsed_prev < budget and (cfg.steps is None or step < cfg.steps):
            # (it exported an untrained drafter with exit 0 unsaid, e.g. where the evaluation before training spent the
            # budget; a resume whose --steps is reached or budget already spent says so above)
            self.say(f"WARNING: time_budget_min {cfg.time_budget_min:g} was spent before a step was trained (it counts "
                     "the evaluations too): the drafter exported is " + (
                         "untrained" if step == 0 else f"the checkpoint's of step {step}, as it was"), "time_budget_min")
        with ignored_interrupt():  # (a Ctrl-C now: the checkpoint, the drafter and its log are written whole)
            # (one that cannot be saved, e.g. a full work dir, leaves the drafter to export, then is said; one of a
            # --ckpt-every save that failed, which stopped training, is not tried again; diverged: nothing is exported)
            stopped = unsaved is not None
            if unsaved is None:
                unsaved = save_checkpoint()
            out_dir, info = export(unsaved)
        if unsaved is not None:  # (the drafter is whole; only --resume, to train on, needs the checkpoint)
            raise named(f"{'training stopped: ' if stopped else ''}the drafter of step {step} is saved in "
                        f"{quoted(out_dir)}, but {unsaved_line(unsaved)}", "resume")
        for line in summary_lines(info, out_dir, cfg.target):
            self.log(line)
        return info


STALE_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")
"""Names of the weight and index files a checkpoint in ``--out`` may hold besides ``model.safetensors``."""


def _say_line(line: str) -> None:
    """Write ``line`` to stderr on a line of its own (:class:`Trainer`'s default log): through
    ``tqdm.write``, which clears the progress bar drawn there and draws it again below (an eval
    line printed while it was drawn was glued to it: ``...[00:00<?, ?step/s]eval step 0: ...``)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def data_line(stats: dict) -> str:
    """The ``data:`` line of a run's data statistics (:func:`prepare_data`'s, which
    training_log.json's ``data`` records in full): what it trains on and what is held out.
    The conversations trained on are those with a reply within seq_len, less the held-out
    ones where the held-out rows are chat ones (``val_kind``; they counted as trained on: trial-325)."""
    parts = []
    if stats.get("documents"):
        parts.append(f"{_count(stats['documents'], 'document')} ({_count(stats.get('stream_tokens', 0), 'token')})")
    if stats.get("conversations"):
        left = stats["conversations"] - stats.get("conversations_without_assistant_turn", 0) \
            - stats.get("conversations_reply_past_seq_len", 0) \
            - (stats.get("val_sequences", 0) if stats.get("val_kind") == "chat" else 0)
        parts.append(_count(stats["conversations"], "conversation")
                     + (f" ({left:,} trained on)" if left != stats["conversations"] else ""))
    if stats.get("distilled_sequences"):
        parts.append(f"{_count(stats['distilled_sequences'], 'self-distilled sequence')} "
                     f"({_count(stats.get('distilled_tokens', 0), 'continuation token')})")
    held = stats.get("val_sequences", 0)
    return (f"data: {', '.join(parts) or 'none'}; "
            + (f"{_count(held, 'sequence')} held out for evaluation" if held else "none held out for evaluation"))


def summary_lines(info: dict, out_dir: Path, target) -> list[str]:
    """The lines said as a run ends, of its training log ``info`` (:meth:`Trainer.run`'s): where
    the drafter is saved, its step, train loss, last evaluation and training time; where its
    training_log.json is; and the command that decodes with it for ``target`` (as given)."""
    ev = info.get("final_eval") or {}
    parts = [f"step {info['steps']}", f"train loss {'-' if info.get('final_train_loss') is None else info['final_train_loss']}"]
    if ev.get("val_loss") is not None:
        parts.append(f"val_loss {ev['val_loss']}")
        parts.append("no val_tau" if ev.get("val_tau") is None else f"val_tau {ev['val_tau']}")
    parts.append(f"{format_duration(info['train_time_s'])} of training")
    return [f"saved drafter to {out_dir} ({', '.join(parts)})",
            f"training log: {out_dir / 'training_log.json'}",
            f"decode with it: dflash-torch generate 'Hello' --target {shlex.quote(str(target))} "
            f"--draft {shlex.quote(str(out_dir))}"]


def format_duration(seconds: float) -> str:
    """``seconds`` as a person reads it: ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if round(seconds, 1) < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def progress_line(step: int, steps: int | None, loss: float | None, lr: float, trained: int, tokens: int,
                  seconds: float, elapsed: float, budget: float | None) -> str:
    """The progress line said where no progress bar is drawn: ``step`` (of ``steps``, where
    given), the train ``loss`` of that step's batch (None: none), the learning rate ``lr``,
    the rate of this invocation (``trained`` steps and ``tokens`` in ``seconds``), the training
    time ``elapsed`` (seconds, over all resumes) and the time left: to ``steps`` at that rate or
    to the ``budget`` (seconds of training, None: none), whichever comes first."""
    rate = trained / seconds if seconds > 0 else 0.0
    left = []
    if steps is not None and rate > 0:
        left.append(max(steps - step, 0) / rate)
    if budget is not None:
        left.append(max(budget - elapsed, 0.0))
    speed = "" if rate <= 0 else (f"{rate:.2f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")
    parts = [f"train loss {'-' if loss is None else loss}", f"lr {lr:.2e}",
             *([f"{speed}, {tokens / seconds:,.0f} tokens/s"] if speed else []),
             f"elapsed {format_duration(elapsed)}", *([f"ETA {format_duration(min(left))}"] if left else [])]
    return f"step {step}{f'/{steps}' if steps is not None else ''}: {', '.join(parts)}"


def _eval_line(e: dict, noted: bool = True) -> str:
    """The line said for an evaluation (see :meth:`Trainer.evaluate`), with its ``val_tau_note``
    where it has one and ``noted``, else a word that it was said above (every line said it all:
    200 characters again at each evaluation, trial-320)."""
    note = "" if "val_tau_note" not in e else f" ({e['val_tau_note']})" if noted else " (nothing to replay: see above)"
    return f"eval step {e['step']}: val_loss {e['val_loss']} val_tau {e['val_tau']}{note}"


def remove_stale_weights(out_dir: Path) -> list[str]:
    """Remove the weight files of a checkpoint that ``model.safetensors`` in ``out_dir``
    replaces (shards, ``.bin`` weights, their index files: names of :data:`STALE_WEIGHTS`,
    and the files the indexes list), so that no loader reads them instead or beside it;
    the directory's other files are kept. Returns the names removed."""
    names = {f.name for f in out_dir.iterdir() if STALE_WEIGHTS.fullmatch(f.name)} - {"model.safetensors"}
    for index in [n for n in names if n.endswith(".index.json")]:
        try:
            listed = json.loads((out_dir / index).read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # (not an index: its own name goes only)
            continue
        names |= {s for s in listed if isinstance(s, str) and "/" not in s and "\\" not in s
                  and s.endswith((".safetensors", ".bin")) and s != "model.safetensors"}
    removed = []
    for name in sorted(names):
        if (out_dir / name).is_file() or (out_dir / name).is_symlink():
            (out_dir / name).unlink()
            removed.append(name)
    return removed


def check_saved_range(state: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], dtype: str) -> None:
    """Refuse to save ``state`` (the weights cast to the ``save_dtype`` ``dtype``) where a
    finite weight of ``trained`` (the same names, as trained) became inf or nan: float16's
    range ends at 65504, and a weight past it would load, then decode wrongly.

    Raises:
        DFlashError: naming the first such weight and its largest magnitude.
    """
    for key, saved in state.items():
        if saved.is_floating_point() and not torch.isfinite(saved).all() and torch.isfinite(trained[key]).all():
            top = trained[key].abs().max().item()
            raise DFlashError(f"the drafter weight {key} holds {top:.4g}, past the range of save_dtype {dtype}: save "
                              "it as bfloat16 or float32")


def export_drafter(drafter: DFlashDrafter, dcfg: DrafterConfig, out_dir: Path, dtype: str = "bfloat16",
                   log=None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the published DFlash (or DFlash 2) drafter format;
    the weight files of a checkpoint it replaces are removed (:func:`remove_stale_weights`; said to ``log``),
    and a file of those names that is a link is replaced by a new file (what it links to is left as it is).

    Both files are written to temporary files in ``out_dir`` first: an error (a full disk) or a
    Ctrl-C while they are written removes them and leaves ``out_dir`` as it was. Then, with
    Ctrl-C ignored, the old ``config.json`` is moved aside (and back where the weights cannot
    be moved into place), the weights are moved into place and the new ``config.json`` last,
    as the mark of a complete drafter: a crash between these renames
    (a kill, a power cut) leaves weights without a config, never weights beside another
    drafter's config. Each file is flushed to the disk before it is moved, and ``out_dir``
    after the moves (:func:`_fsync`): a power cut cannot leave a moved file empty.

    Raises:
        DFlashError: a weight past the range of ``dtype`` (float16: :func:`check_saved_range`).
        OSError: a file could not be written (``out_dir`` then holds what it held) or moved.
        safetensors.SafetensorError: the weights could not be written (e.g. a full disk; ``out_dir``
            then holds what it held).
    """
    from safetensors.torch import save_file

    from ..options import resolve_save_dtype

    torch_dtype = resolve_save_dtype(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in drafter.state_dict().items()}
    check_saved_range(state, drafter.state_dict(), dtype)
    cfg = exported_config(dcfg, dtype)
    temps = []
    try:
        weights, config = _temp_path(out_dir, "model.safetensors", temps), _temp_path(out_dir, "config.json", temps)
        save_file(state, str(weights), metadata={"format": "pt"})
        config.write_text(json.dumps(cfg, indent=2) + "\n")
        for tmp in (weights, config):
            os.chmod(tmp, 0o644)  # (safetensors and mkstemp create them owner-only)
            _fsync(tmp)  # (on the disk before its name is: a power cut after the rename left it empty)
        with ignored_interrupt():  # (os.replace replaces a link itself, not the file it names)
            old = out_dir / "config.json"
            aside = None  # (the old config, kept until the new weights are in place)
            if old.is_symlink() or old.exists():
                aside = _temp_path(out_dir, "config.json.old", temps)
                os.replace(old, aside)
            try:
                os.replace(weights, out_dir / "model.safetensors")
            except OSError:  # (the old weights stay: so does their config)
                if aside is not None:
                    os.replace(aside, old)
                raise
            removed = remove_stale_weights(out_dir)
            os.replace(config, out_dir / "config.json")
            _fsync(out_dir)  # (the renames)
    finally:
        for tmp in temps:  # (those not moved into place: an error or a Ctrl-C while they were written)
            tmp.unlink(missing_ok=True)
    if removed and log is not None:
        log(f"removed the weight files of the checkpoint replaced in {out_dir}: {', '.join(removed)}")
    return out_dir


def exported_config(dcfg: DrafterConfig, dtype: str = "bfloat16") -> dict:
    """The ``config.json`` dict :func:`export_drafter` writes for ``dcfg`` with its weights saved
    in ``dtype`` (a ``--save-dtype`` value): its ``torch_dtype`` is that dtype.

    Raises:
        DFlashError: an unknown ``dtype``.
    """
    from ..options import resolve_save_dtype

    return {**dcfg.to_dict(), "torch_dtype": str(resolve_save_dtype(dtype)).removeprefix("torch.")}


def _write_replacing(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file moved into place: an error (a full
    disk) leaves what ``path`` held; a link there is replaced, not written through. The file is
    flushed to the disk before it is moved, and its directory after (:func:`_fsync`).

    Raises:
        OSError: it could not be written or moved.
    """
    temps: list[Path] = []
    try:
        tmp = _temp_path(path.parent, path.name, temps)
        tmp.write_text(text)
        os.chmod(tmp, 0o644)  # (mkstemp creates it owner-only)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


def foreign_checkpoint(path: Path) -> bool:
    """Whether the file ``path`` is told cheaply, without unpickling it, to be no training
    checkpoint: a ``torch.save`` archive whose pickle names no ``drafter_config``. A file that
    cannot be told so (unreadable, not such an archive) -> False."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1 or archive.getinfo(pickles[0]).file_size > 1 << 26:
                return False
            return b"drafter_config" not in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile):
        return False


def write_error_reason(exc: Exception, partial: Path | None = None, dest: Path | None = None) -> str:
    """Why writing a file failed, in a few words (e.g. ``No space left on device``), from ``exc``:
    an ``OSError``, a ``safetensors`` error (which names the OS error in its text) or
    ``torch.save``'s ``RuntimeError`` (which does not: the OS error is then asked for by writing
    on to ``partial``, the file it left, which is to be removed, and else the free space left
    tells a full disk); else the error's text. With ``dest``, the file the message names, an
    OS error about another file names that one (``cannot write work/checkpoint.tmp: Is a
    directory``, a directory where ``partial`` goes)."""
    def said(err: OSError) -> str:
        # (a rename's error is about either of its two paths: not named)
        name = os.fsdecode(err.filename) if err.filename is not None and err.filename2 is None else None
        if dest is not None and name is not None and Path(name) != Path(dest):
            return f"cannot write {name}: {err.strerror or err}"
        return err.strerror or str(err)

    if isinstance(exc, OSError):
        return said(exc)
    text = " ".join(str(exc).split())
    found = re.search(r"error: ([^:()]+?) \(os error \d+\)", text)
    if found:
        return found.group(1)
    if partial is not None:
        try:
            with open(partial, "ab") as f:
                f.write(bytes(1 << 20))
                f.flush()
            if shutil.disk_usage(partial.parent).free < 1 << 20:
                return "No space left on device"
        except OSError as probe:
            if probe.strerror:
                return said(probe)
    return f"the file could not be written whole ({text[:120]})"


def _fsync(path: Path) -> None:
    """Flush ``path`` to the disk (``os.fsync``): a file's bytes, before it is moved into place,
    or a directory's entries, after files were moved into it, so that a power cut cannot leave
    a moved file's name on an empty file. A directory the OS cannot open or flush (Windows,
    some network file systems) is passed over.

    Raises:
        OSError: a file that cannot be opened or flushed.
    """
    directory = path.is_dir()
    try:
        fd = os.open(path, os.O_RDONLY if directory else os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not directory:
            raise


def _temp_path(out_dir: Path, name: str, made: list[Path]) -> Path:
    """A new empty hidden file in ``out_dir`` (appended to ``made``) to write ``name`` to before
    it replaces ``name``."""
    fd, path = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    made.append(Path(path))
    return made[-1]
