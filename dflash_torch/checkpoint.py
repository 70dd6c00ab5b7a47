"""Locate Hugging Face format checkpoints and read their config and safetensors weights.

A checkpoint is a directory with ``config.json`` and either ``model.safetensors`` or
a sharded set described by ``model.safetensors.index.json``. It may be given as a
local path or as a Hugging Face repo id: one already in the local cache is used as it is (no
network), another is downloaded into the cache with ``huggingface_hub`` (unless
``HF_HUB_OFFLINE`` is set).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Callable

import psutil
import torch
from safetensors import safe_open

from .errors import DFlashError, OptionError, shown


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """Return the local directory of a checkpoint.

    Args:
        name_or_path: a local directory, or a Hugging Face repo id (``ORG/NAME``, or
            ``ORG/NAME@REVISION`` for a branch, tag or commit hash, e.g. ``acme/model@v2``,
            ``acme/model@refs/pr/3``; else its ``main`` branch): its snapshot of that revision in
            the local Hugging Face cache when that holds the checkpoint (used as it is, no
            network), else downloaded into the cache (:func:`dflash_torch.hub.snapshot`).

    Raises:
        DFlashError: if it is empty, neither a directory with ``config.json`` nor a repo id
            (a ``config.json`` that is not a file: ``PATH/config.json is not a file``; a Hub
            page's URL, ``hf://ORG/NAME`` or ``ORG/NAME/``: naming the id it means,
            :func:`dflash_torch.hub.meant_id`), a broken symbolic link (not passed over for the
            Hub id of the same name),
            a repo id that is not cached and cannot be downloaded, or a revision the Hub does not
            have (see :mod:`dflash_torch.hub`),
            or a directory (or a part of a Hugging Face cache entry: its folder, refs/main,
            snapshot, blobs) this process may not read (``cannot read PATH: Permission denied``).
    """
    if not str(name_or_path).strip():  # (Path("") is ".", the current directory)
        raise DFlashError("the checkpoint path is empty: pass a checkpoint directory or a Hugging Face id")
    path = Path(os.path.expanduser(name_or_path))
    try:
        if path.is_dir():
            os.listdir(path)  # (loading lists it: a directory that cannot be listed is refused here)
            config = path / "config.json"
            try:
                found = config.is_file()  # (PermissionError in a directory that cannot be entered: named below)
            except OSError as exc:
                config.lstat()  # (it can be entered: config.json is a link into a directory that cannot be)
                raise DFlashError(f"cannot read {config}: {exc.strerror}") from None
            if not found and config.exists():  # (a directory: "has no config.json" sent one looking for the file)
                raise DFlashError(f"{config} is not a file{' (a directory)' if config.is_dir() else ''}")
            if not found:
                raise DFlashError(f"{path} has no config.json: not a Hugging Face checkpoint directory"
                                  + (cache_entry_hint(path) or stopped_training_hint(path)))
            return path
        exists = path.exists()
        link = None if exists or not path.is_symlink() else os.readlink(path)
    except OSError as exc:
        raise DFlashError(f"cannot read {path}: {exc.strerror}") from None
    if exists:
        raise DFlashError(f"{path} is a file; pass the checkpoint directory")
    if link is not None:  # (./ORG/NAME a broken link: a local directory comes before an id, so not the Hub's model unsaid)
        raise DFlashError(f"{path} is a broken symbolic link (to {link}); a local path comes before a Hugging Face id: "
                          "fix or remove the link (or run from another directory to load the Hub's model)")
    name = str(name_or_path)
    if name.partition("@")[0].count("/") == 1 and not name.startswith((".", "/")):  # (refs/pr/3 of ORG/NAME@refs/pr/3)
        from .hub import snapshot

        return snapshot(name)
    from .hub import meant_id

    meant = meant_id(name)  # (a Hub page's URL, hf://ORG/NAME, ORG/NAME/, models--ORG--NAME: the id they mean)
    hint = (f" (a Hugging Face id is written ORG/NAME: {meant})" if meant is not None
            else "" if "/" in name else " (a Hugging Face id is ORG/NAME)")
    raise DFlashError(f"model directory {name!r} does not exist{hint}")


def cache_entry_hint(path: Path) -> str:
    """Where the directory ``path`` is a repo's folder in the Hugging Face cache
    (``.../hub/models--ORG--NAME``, which holds ``refs`` and ``snapshots``, not the checkpoint):
    the id to pass instead, and the snapshot folder of the commit its ``refs/main`` names where
    that is complete (config.json and weights: one that is not would fail too, trial-328), as
    words to append to an error (led by ``"; "``); else ""."""
    from .hub import _complete, meant_id

    repo = meant_id(path.name) if path.name.startswith("models--") else None
    snapshots = path / "snapshots"
    if repo is None or not snapshots.is_dir():
        return ""
    try:
        main = path / "refs" / "main"
        commit = main.read_text().strip() if main.is_file() else ""
        whole = bool(commit) and "/" not in commit and (snapshots / commit).is_dir() and _complete(snapshots / commit)
    except (OSError, UnicodeDecodeError):  # (a refs file that is no text: trial-328)
        whole = False
    where = f", or its snapshot folder {snapshots / commit}" if whole else ""
    return f"; it is the Hugging Face cache entry of {repo}: pass {repo}{where}"


def stopped_training_hint(path: Path) -> str:
    """Where the directory ``path`` holds the default work dir (``train_work``) of a
    ``dflash-torch train`` run that stopped before it exported the drafter there: what exports
    it (with its ``checkpoint.pt``: the run's command again with ``--resume``, else the command
    again), as words to append to an error (led by ``" ("``); else "". Where a live train run
    holds ``path`` or that work dir (its lock, :class:`~dflash_torch.training.runlock.RunLock`,
    whose holder Linux names), that the run (its PID) is in progress there instead."""
    work = path / "train_work"  # (TrainConfig.work_path's default)
    pid = _training_pid(path, work)
    if pid is not None:  # (it said "stopped" of a run still training, whose --resume was then refused: trial-325)
        return (f" (a dflash-torch train run, PID {pid}, is in progress there: it exports the drafter there when it "
                "ends; wait for it to end)")
    try:
        if not work.is_dir():
            return ""
        saved = (work / "checkpoint.pt").is_file()
    except OSError:
        return ""
    if saved:
        return (f" (it holds {work}, the checkpoint of a dflash-torch train run stopped before its drafter was "
                "exported: that train command again with --resume continues it and exports the drafter)")
    return (f" (it holds {work}, the work dir of a dflash-torch train run stopped before training began: that "
            "train command again trains and exports the drafter)")


def _training_pid(*dirs: Path) -> int | None:
    """The process ID of a live train run that holds one of ``dirs`` (its lock file's holder,
    as Linux's ``/proc/locks`` tells it); None where none does or it cannot be told."""
    from .training.runlock import LOCK_NAME  # (only here: the training package is heavy to import)

    files = []
    for d in dirs:
        try:
            if (d / LOCK_NAME).is_file():  # (a killed run's file: held by no one)
                files.append(d / LOCK_NAME)
        except OSError:
            pass
    if not files:
        return None
    from .training.runlock import holder_pid

    return next((pid for pid in map(holder_pid, files) if pid is not None), None)


def checkpoint_dir(value, name: str) -> Path:
    """:func:`resolve_model_dir` of the ``name`` argument (``target``, ``draft``, ``init_from``),
    its error naming the argument (the flag, ``--target``, on the command line).

    Raises:
        OptionError: as :func:`resolve_model_dir`, the message led by ``name``.
    """
    try:
        return resolve_model_dir(value)
    except OptionError:
        raise
    except DFlashError as exc:
        raise OptionError(f"{name}: {exc}", name) from None


def read_json_object(path: Path) -> dict:
    """The JSON object (a dict) in the file ``path``.

    Raises:
        DFlashError: a file that cannot be read, is not UTF-8 JSON, or holds another JSON value.
    """
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{path} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise DFlashError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(value, dict):
        raise DFlashError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def load_config(model_dir: Path) -> dict:
    """Read ``config.json`` of a checkpoint directory as a dict. An older NVIDIA ModelOpt
    checkpoint declares its quantization in a separate ``hf_quant_config.json``: where
    ``config.json`` has no ``quantization_config``, that file's is set as it
    (:func:`~dflash_torch.models.nvfp4.hf_quant_config`), so that it is read or refused like
    one written in ``config.json``.

    Raises:
        DFlashError: see :func:`read_json_object`; a ``hf_quant_config.json`` that is not
            valid JSON with a ``quantization`` object; more layers than weights
            (:func:`check_layer_count`).
    """
    from .models.nvfp4 import hf_quant_config

    cfg = read_json_object(Path(model_dir) / "config.json")
    quant = hf_quant_config(model_dir, cfg)
    if quant is not None:
        cfg["quantization_config"] = quant
    check_layer_count(model_dir, cfg)
    return cfg


MANY_LAYERS = 1024  # more layers than a model has: such a count is checked against the checkpoint's tensors first


def check_layer_count(model_dir: Path, cfg: dict) -> None:
    """Refuse a ``config.json`` (dict ``cfg``) whose ``num_hidden_layers`` (top level or in
    ``text_config``) is over :data:`MANY_LAYERS` and more than the checkpoint's tensors: each
    layer has weights of its own, so the loader would refuse it as missing weights, but only
    after building per-layer tables and modules of that many entries (``10**12`` layers: out
    of memory). A smaller count is left to the loader (cheap to build; no file is opened
    before the memory check). Only the safetensors headers are read; weights that cannot be
    listed are left to the loader, which refuses them with its own message.

    Raises:
        DFlashError: ``.../config.json num_hidden_layers 1000000000000 is more than the
            checkpoint's 37 weights ...``.
    """
    text = cfg.get("text_config")
    for prefix, where in (("", cfg), ("text_config.", text if isinstance(text, dict) else {})):
        n = where.get("num_hidden_layers")
        if not isinstance(n, int) or isinstance(n, bool) or n <= MANY_LAYERS:
            continue
        try:
            count = len(tensor_names(model_dir))
        except DFlashError:
            return
        if n > count:
            raise DFlashError(f"{Path(model_dir) / 'config.json'} {prefix}num_hidden_layers {shown(n)} is more than "
                              f"the checkpoint's {count} weights (each layer has weights of its own): config.json "
                              "does not describe these weights")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` when there is one, else
    the shards of ``model.safetensors.index.json``, else every ``*.safetensors`` file (the
    order transformers reads them in, so a directory holding both a single file and an
    index loads the weights transformers loads).

    Raises:
        DFlashError: if no safetensors weights are present (naming any ``*.bin`` weights there,
            which it does not read, and how to convert them), the index is not valid JSON with a
            ``weight_map`` of shard file names in the directory (naming a bad entry), a shard is missing, or a weight file is not a readable file (a dangling
            link of an interrupted download, a directory).
    """
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.exists() or single.is_symlink():
        files = [single]
    elif index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise DFlashError(f"{index} has no weight_map (an object mapping each weight to its shard file)")
        for name, shard in weight_map.items():  # (one bad entry was "has no weight_map"; "/etc/passwd" was opened)
            if not isinstance(shard, str):
                raise DFlashError(f"{index}: weight_map maps {name} to {json.dumps(shard)}, not a shard file name")
            norm = os.path.normpath(shard)
            if not shard or os.path.isabs(shard) or norm == "." or norm == ".." or norm.startswith(".." + os.sep):
                raise DFlashError(f"{index}: weight_map maps {name} to {shard!r}, which is not a file of the "
                                  f"checkpoint (a file name in {model_dir})")
        shards = sorted({os.path.normpath(s) for s in weight_map.values()})  # ("./a" and "a": one file)
        check_links(model_dir, shards)
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise DFlashError(f"{model_dir}: shard(s) listed in model.safetensors.index.json are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(f.name for f in model_dir.glob("*.bin"))  # (pytorch_model.bin, its shards)
        hint = (f"; it holds {', '.join(pickles[:3])}{' ...' if len(pickles) > 3 else ''} (PyTorch pickle weights), "
                "which dflash-torch does not read: convert them to safetensors, e.g. load the model with transformers "
                "and save_pretrained(DIR, safe_serialization=True)") if pickles else ""
        raise DFlashError(f"{model_dir} has no safetensors weights (model.safetensors or model.safetensors.index.json)"
                          + hint)
    check_links(model_dir, [f.name for f in files])
    unreadable = [f.name for f in files if not f.is_file()]  # (a directory)
    if unreadable:
        raise DFlashError(f"{model_dir}: {', '.join(unreadable)} is not a readable file")
    return files


def missing_note(model_dir: Path, missing: list[str], unused=()) -> str:
    """What a checkpoint tells of the weights ``missing`` (their names in it) that it lacks, as
    a note to follow ``lacks weights: ...`` ("" where it tells nothing): index entries that map
    them to shards without them; all of them found among ``unused`` (the checkpoint's weights
    the model does not take) under one prefix, e.g. ``model.fc.weight`` for ``fc.weight`` (or
    ``model.midlayer.*`` for a drafter's ``layers.0.*``, which ``midlayer.*`` names)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if not (model_dir / "model.safetensors").exists() and index.is_file():  # (else the index is not read)
        weight_map = read_json_object(index).get("weight_map") or {}
        wrong = [m for m in missing if m in weight_map]  # (each listed shard was read: it is not in its shard)
        if wrong:
            entries = ", ".join(f"{m} to {weight_map[m]}" for m in wrong[:3])
            return (f" (model.safetensors.index.json maps {entries}{' ...' if len(wrong) > 3 else ''}, which does not "
                    f"hold {'it' if len(wrong) == 1 else 'them'}: a wrong index?)")
    # (a drafter's EAGLE-style midlayer.* names are read as layers.0.*: models.drafter.eagle_layer_names)
    as_read = {re.sub(r"(^|\.)midlayer\.", r"\1layers.0.", n, count=1): n for n in unused}
    prefixes = {n[: -len(m)] for m in missing for n in as_read if n.endswith("." + m)}
    if len(prefixes) == 1 and all(next(iter(prefixes)) + m in as_read for m in missing):
        prefix = next(iter(prefixes))
        return (f" (it holds them under the prefix {prefix!r}: {as_read[prefix + missing[0]]}"
                f"{', ...' if len(missing) > 1 else ''}; rename them without it)")
    return ""


def check_links(model_dir: Path, names=None, passed=()) -> None:
    """Refuse a checkpoint file that is a link to nothing: huggingface_hub links a
    snapshot's files to its blobs, and a download cut short leaves links without them.

    Args:
        model_dir: the checkpoint directory.
        names: the file names to check (default: every file of ``model_dir``).
        passed: file names not checked (loading reads a broken link to one as absent).

    Raises:
        DFlashError: naming the broken links; a directory this process may not list or enter,
            or a file of ``names`` in one (naming the path that failed); a link into a directory
            it may not enter (naming the link).
    """
    model_dir = Path(model_dir)
    try:
        paths = list(model_dir.iterdir()) if names is None else [model_dir / n for n in names]
        links = [p for p in paths if p.name not in passed and p.is_symlink()]
    except OSError as exc:  # (the path that failed: a file of an index's subdirectory that may not be entered too)
        raise DFlashError(f"cannot read {exc.filename or model_dir}: {exc.strerror}") from None
    broken = []
    for link in links:
        try:
            if not link.exists():
                broken.append(link.name)
        except OSError as exc:  # (a link into a directory this process may not enter: it is the file that cannot be read)
            raise DFlashError(f"cannot read {link}: {exc.strerror}") from None
    broken.sort()
    if broken:
        raise DFlashError(f"{model_dir}: {', '.join(broken)} {'is a broken link' if len(broken) == 1 else 'are broken links'}"
                          " (an interrupted download? download the checkpoint again)")


def load_state_dict(model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                    keep: Callable[[str], bool] | None = None,
                    fp8_block: tuple[int, int] | None = None, keep_fp8: bool = False,
                    int_quant: tuple[int, int | None] | None = None, keep_int: bool = False,
                    float32: Callable[[str], bool] | None = None, scale_fmt: str = "float",
                    fp4: bool = False, keep_fp4: bool = False, nvfp4: str | None = None,
                    keep_nvfp4: bool = False, what: str = "target") -> dict[str, torch.Tensor]:
    """Load the tensors of a checkpoint, cast to ``dtype``, onto ``device``.

    Args:
        keep: read only the tensors whose name it accepts (the others are never
            materialized); None reads all.
        fp8_block: the ``weight_block_size`` of a fine-grained FP8 checkpoint (see
            :mod:`dflash_torch.models.fp8`): each ``X.weight`` with an ``X.weight_scale_inv``
            is dequantized into ``X.weight`` in ``dtype`` as it is read (on ``device``), and
            the scale is dropped; None: a checkpoint without FP8 weights.
        keep_fp8: with ``fp8_block``, keep each such pair FP8 instead: ``X.weight`` as stored
            (``float8_e4m3fn``, on ``device``) and ``X.weight_scale``, its row scales
            (float32 ``[..., rows, ceil(cols / bi)]``, :func:`~dflash_torch.models.fp8.row_scales`),
            after checking that their products are finite in ``dtype`` (as a dequantized weight is).
        int_quant: ``(bits, group_size)`` of a compressed-tensors pack-quantized checkpoint
            (see :mod:`dflash_torch.models.packed_int`): each ``X.weight_packed`` with its
            ``X.weight_scale`` and ``X.weight_shape`` is dequantized into ``X.weight`` in
            ``dtype`` as it is read; None: a checkpoint without packed integer weights.
        keep_int: with ``int_quant``, keep each packed weight instead: ``X.weight`` the int32
            words (on ``device``) and ``X.weight_scale`` its scales (as stored), after checking
            them; a weight whose rows end inside a word is dequantized all the same.
        float32: the names of floating-point tensors cast to float32 instead of ``dtype``
            (e.g. a router transformers keeps in float32); None: none.
        scale_fmt: with ``fp8_block``, the config's ``scale_fmt`` (``"float"``, or ``"ue8m0"``:
            one-byte power-of-two scales, DeepSeek-V4). The scale of an FP8 ``X.weight`` is
            ``X.weight_scale_inv`` or, as DeepSeek names it, ``X.scale`` (a ``X.scale`` beside
            an unquantized ``X.weight`` is an ordinary tensor).
        fp4: with ``fp8_block``, the checkpoint's experts are FP4 (DeepSeek-V4's ``expert_dtype:
            "fp4"``): an int8 ``X.weight`` with its scale is an FP4 pair
            (:func:`~dflash_torch.models.mxfp4.check_fp4_pair`), dequantized into ``dtype`` as it
            is read (:func:`~dflash_torch.models.mxfp4.dequantize_fp4`).
        keep_fp4: with ``fp4``, keep each FP4 pair instead: ``X.weight`` its bytes (uint8
            ``[..., rows, cols / 2]``) and ``X.weight_scale`` its exponents (uint8 ``[..., rows,
            cols / 32]``), after checking that they are finite.
        nvfp4: the format of a checkpoint whose weights are dequantized into ``dtype`` as they
            are read (:mod:`~dflash_torch.models.nvfp4`; the activation scales are dropped):
            ``"compressed-tensors"`` (each ``X.weight_packed`` with its ``X.weight_scale`` and
            ``X.weight_global_scale``), ``"modelopt"`` (each uint8 ``X.weight`` with its
            ``X.weight_scale`` and ``X.weight_scale_2``), ``"modelopt-fp8"`` (each
            float8_e4m3fn ``X.weight`` with its per-tensor ``X.weight_scale``) or
            ``"modelopt-mixed"`` (either, by the weight's dtype); None: none.
        keep_nvfp4: with ``nvfp4``, keep each NVFP4 weight instead (ModelOpt's FP8 weights are
            dequantized all the same): ``X.weight`` its bytes (uint8 ``[..., rows, cols / 2]``)
            and ``X.weight_scale`` its scales (:func:`~dflash_torch.models.nvfp4.joined_scales`:
            uint8 ``[..., rows, cols / 16 + 4]``), after checking that its values are finite
            in ``dtype``.
        what: ``"target"`` or ``"drafter"`` (whose weights are read unquantized only), for errors.

    Raises:
        DFlashError: a weight file that is not valid safetensors (corrupt or truncated), a
            weight name in two files, an FP8 (float8) tensor in a checkpoint whose config does
            not say FP8 (or in a drafter's), a GPTQ-style packed weight (``X.qweight``), a
            finite weight whose values overflow the dtype it is cast to (e.g. float64 1e300 in
            float32); with ``fp8_block``: an FP8 weight without its scale or a scale without
            its weight, static activation scales (``input_scale``), or a pair
            :func:`~dflash_torch.models.fp8.dequantize` refuses; with ``keep_fp8``: a NaN
            byte, or a product that overflows ``dtype``; with ``int_quant``: a weight stored
            both packed and not, a packed weight without its scale or shape, a scale or shape without its packed weight, a zero
            point or group index, or what :func:`~dflash_torch.models.packed_int.dequantize`
            refuses; with ``fp8_block``: a weight with two scales (``X.weight_scale_inv`` and
            ``X.scale``), an int8 weight with a scale where ``fp4`` is False, a routed expert's
            FP8 weight where it is True (a mixed layout), an int8 ``X.weight`` without its scale
            where it is True, an FP4 pair :func:`~dflash_torch.models.mxfp4.check_fp4_pair`
            refuses, or an ``X.scale`` that :func:`_check_scale_owner` refuses (beside a weight
            neither quantized nor floating point, e.g. FP4 bytes stored as uint8; a float8 scale
            beside an unquantized weight or without one), no FP8 (or FP4) weight at all (among
            those ``keep`` takes); with ``nvfp4``: a weight stored both
            packed and not, a quantized weight without one of its scales, a scale without its
            quantized weight, a zero point, a float8 weight in an NVFP4 checkpoint, no quantized
            weight at all, or what :mod:`~dflash_torch.models.nvfp4`'s dequantizers refuse.
    """
    from .models import fp8, mxfp4, packed_int

    files = weight_files(model_dir)
    source = _tensor_sources(model_dir, files)
    kinds = _tensor_dtypes(files) if fp8_block is not None or nvfp4 is not None else {}
    state, dequantized, packed_ints = {}, 0, 0
    for file in files:
        with _open(file) as f:
            for key in f.keys():
                if keep is not None and not keep(key):
                    continue
                if key.endswith(".qweight"):  # (AutoGPTQ / AutoAWQ: X.qweight, X.scales, X.qzeros)
                    file = ", with a quantize_config.json" if (Path(model_dir) / "quantize_config.json").is_file() else ""
                    other = " (or one of the quantized formats the README lists)" if what == "target" else ""
                    raise DFlashError(f"{model_dir}: {key} is a GPTQ-style packed weight (qweight / scales / qzeros{file}), "
                                      f"a format dflash-torch does not read: use an unquantized {what} checkpoint{other}")
                if nvfp4 is not None:
                    read = _nvfp4_tensor(model_dir, f, key, source, kinds, nvfp4, dtype, device, keep_nvfp4)
                    if read is not None:
                        if read[1] is not None:
                            state.update(read[1])
                            dequantized += 1
                        continue
                if int_quant is not None and _packed_int_part(model_dir, key, source):
                    continue  # (read with its packed weight)
                if int_quant is not None and key.endswith(packed_int.PACKED):
                    name = key.removesuffix(packed_int.PACKED)
                    if name in source:  # (which one would win would depend on the files' order)
                        raise DFlashError(f"{model_dir}: both {name} and the packed {key}")
                    parts = []
                    for suffix in (packed_int.SCALE, packed_int.SHAPE):
                        if name + suffix not in source:
                            raise DFlashError(f"{model_dir}: packed weight {key} has no {name + suffix}")
                        with _open(source[name + suffix]) as g:
                            parts.append(g.get_tensor(name + suffix))
                    packed = f.get_tensor(key).to(device)
                    scale, cols = packed_int.check_parts(packed, parts[0], parts[1], *int_quant, name)
                    if keep_int and cols * int_quant[0] % 32 == 0:
                        state[name], state[name + packed_int.SCALE] = packed, scale
                    else:  # (a row that ends inside a word is dequantized even when the others stay packed)
                        state[name] = packed_int.dequantize_groups(packed, scale, *int_quant, cols, dtype)
                    packed_ints += 1
                    continue
                if fp8_block is not None and key.endswith(fp8.SCALE_SUFFIX):
                    if key.removesuffix(fp8.SCALE_SUFFIX) not in source:
                        raise DFlashError(f"{model_dir}: FP8 scale {key} has no weight "
                                          f"{key.removesuffix(fp8.SCALE_SUFFIX)}")
                    continue  # read with its weight
                if fp8_block is not None and _deepseek_scale(key, kinds):
                    continue  # (DeepSeek's name for the scale of X.weight: read with it)
                if fp8_block is not None and key.endswith(".scale"):
                    _check_scale_owner(model_dir, key, kinds, fp4)
                if fp8_block is not None and key.rsplit(".", 1)[-1] in fp8.STATIC_SCALES:
                    raise DFlashError(f"{model_dir}: {key} is a static FP8 activation scale; dflash-torch reads "
                                      "only dynamic-activation FP8 checkpoints")
                t = f.get_tensor(key)
                scale_key = _scale_name(model_dir, key, kinds) if fp8_block is not None else None
                if scale_key is not None:
                    with _open(source[scale_key]) as g:
                        scale = g.get_tensor(scale_key)
                    dequantized += 1
                    if t.dtype == torch.int8:  # two FP4 elements a byte (DeepSeek-V4's expert_dtype 'fp4')
                        if not fp4:
                            raise DFlashError(f"{model_dir}: weight {key} is int8 with a scale {scale_key} (FP4 "
                                              "experts) but config.json declares no expert_dtype 'fp4'")
                        mxfp4.check_fp4_pair(t, scale, key, scale_key)
                        if keep_fp4:
                            state[key] = t.view(torch.uint8).to(device)
                            state[key + fp8.ROW_SCALE_SUFFIX] = scale.view(torch.uint8).to(device)
                        else:
                            state[key] = mxfp4.dequantize_fp4(t.to(device), scale.to(device), dtype)
                        continue
                    if fp4 and t.dtype == fp8.FORMAT and _ROUTED_EXPERT.search(key):
                        raise DFlashError(f"{model_dir}: routed expert weight {key} is float8_e4m3fn but config.json "
                                          "declares expert_dtype 'fp4' (a mixed layout)")
                    if keep_fp8:
                        fp8.check_pair(t, scale, fp8_block, key, scale_fmt, scale_key)
                        fp8.check_finite_bytes(t, key)
                        t, rows = t.to(device), fp8.row_scales(scale.to(device), fp8_block, t.shape[-2])
                        fp8.check_finite_product(t, rows, fp8_block[1], dtype, key)
                        state[key], state[key + fp8.ROW_SCALE_SUFFIX] = t, rows
                    else:
                        state[key] = fp8.dequantize(t.to(device), scale, fp8_block, dtype, key, scale_fmt, scale_key)
                elif fp4 and t.dtype == torch.int8 and key.endswith(".weight"):
                    raise DFlashError(f"{model_dir}: weight {key} is an FP4 weight (int8) without its scale "
                                      f"{key.removesuffix('.weight')}.scale (or {key + fp8.SCALE_SUFFIX})")
                elif t.dtype in _FLOAT8:
                    raise DFlashError(
                        f"{model_dir}: weight {key} is {str(t.dtype).removeprefix('torch.')}"
                        + (f" without its scale {key + fp8.SCALE_SUFFIX}"
                           + (f" (or {key.removesuffix('.weight')}.scale)" if key.endswith(".weight") else "")
                           if fp8_block is not None else
                           " but config.json has no FP8 quantization_config (quant_method 'fp8')" if what == "target"
                           else "; dflash-torch reads drafters unquantized only (float32/bfloat16/float16 weights): a "
                           "drafter must be trained or exported unquantized (a quantization_config is refused too)"))
                else:
                    want = torch.float32 if float32 is not None and float32(key) else dtype
                    state[key] = t.to(device=device, dtype=want) if t.is_floating_point() else t.to(device)
                    if (t.is_floating_point() and torch.finfo(t.dtype).max > torch.finfo(want).max
                            and not all_finite(state[key]) and all_finite(t)):
                        raise DFlashError(f"{model_dir}: weight {key} holds {str(t.dtype).removeprefix('torch.')} "
                                          f"values beyond the range of {str(want).removeprefix('torch.')}, the dtype "
                                          "it is loaded in (they overflow to infinity)")
    if fp8_block is not None and not dequantized:
        raise DFlashError(f"{model_dir}: config.json declares fine-grained FP8 weights (quant_method 'fp8') but the "
                          f"checkpoint holds none (float8_e4m3fn X.weight with X.weight{fp8.SCALE_SUFFIX})")
    if int_quant is not None and not packed_ints:  # (transformers refuses such a checkpoint too)
        raise DFlashError(f"{model_dir}: config.json declares compressed-tensors pack-quantized weights but the "
                          f"checkpoint holds none (int32 X.weight{packed_int.PACKED} with X.weight{packed_int.SCALE} "
                          f"and X.weight{packed_int.SHAPE})")
    if nvfp4 is not None and not dequantized:
        what = {"compressed-tensors": "compressed-tensors nvfp4-pack-quantized weights (X.weight_packed)",
                "modelopt": "ModelOpt NVFP4 weights (uint8 X.weight with X.weight_scale_2)",
                "modelopt-fp8": "ModelOpt FP8 weights (float8_e4m3fn X.weight with X.weight_scale)"}.get(
                    nvfp4, "ModelOpt MIXED_PRECISION weights (uint8 or float8_e4m3fn X.weight with X.weight_scale)")
        raise DFlashError(f"{model_dir}: config.json declares {what.split(' (')[0]} but the checkpoint holds none "
                          f"({what.split(' (')[1]}")
    return state


def _nvfp4_tensor(model_dir: Path, f, key: str, source: dict[str, Path], kinds: dict[str, str], fmt: str,
                  dtype: torch.dtype, device, keep: bool = False) -> tuple[str, dict[str, torch.Tensor] | None] | None:
    """Read ``key`` of an NVFP4 / ModelOpt checkpoint (``fmt``: see :func:`load_state_dict`'s
    ``nvfp4``) from the open file ``f``: ``(key, {X.weight: its dequantized matrix})`` for a
    quantized weight (``keep``: an NVFP4 one as ``{X.weight: its bytes, X.weight_scale: its
    joined scales}``), ``(key, None)`` for a part read with its weight or an activation scale
    (not used), None for an ordinary tensor.

    Raises:
        DFlashError: as :func:`load_state_dict` says for ``nvfp4``.
    """
    from .models import nvfp4

    def part(name: str) -> torch.Tensor:
        with _open(source[name]) as g:
            return g.get_tensor(name)

    def kept(name: str, packed: torch.Tensor, scale: torch.Tensor, rows_scale: torch.Tensor, kind: int) -> dict:
        scale = scale.to(device)
        nvfp4.check_finite(packed, scale, rows_scale.to(device), kind, dtype, key)
        return {name: packed, name + "_scale": nvfp4.joined_scales(scale, rows_scale)}

    if fmt == nvfp4.CT_METHOD:
        suffixes = (nvfp4.CT_SCALE, nvfp4.CT_GLOBAL, "weight_shape", nvfp4.CT_INPUT)
        if key.endswith("." + nvfp4.CT_PACKED):
            name = key.removesuffix("_packed")
            base = name.removesuffix("weight")
            if name in source:  # (which one would win would depend on the files' order)
                raise DFlashError(f"{model_dir}: both {name} and the packed {key}")
            for suffix in (nvfp4.CT_SCALE, nvfp4.CT_GLOBAL):
                if base + suffix not in source:
                    raise DFlashError(f"{model_dir}: NVFP4 weight {key} has no {base + suffix}")
            packed = f.get_tensor(key).to(device)
            if base + "weight_shape" in source:  # (older writers stored the shape too)
                shape = part(base + "weight_shape")
                if shape.is_floating_point() or shape.flatten().tolist() != [packed.shape[-2], 2 * packed.shape[-1]]:
                    raise DFlashError(f"{model_dir}: {base}weight_shape {shape.tolist()} does not match {key} of "
                                      f"shape {tuple(packed.shape)} (two FP4 values a byte)")
            scale, global_scale = part(base + nvfp4.CT_SCALE), part(base + nvfp4.CT_GLOBAL)
            if keep:
                rows = nvfp4.check_parts(packed, scale, global_scale, key, base + nvfp4.CT_SCALE, base + nvfp4.CT_GLOBAL)
                return key, kept(name, packed, scale, rows, nvfp4.CT)
            return key, {name: nvfp4.dequantize_ct(packed, scale, global_scale, dtype, name)}
        if key.endswith(".weight_zero_point"):
            raise DFlashError(f"{model_dir}: {key} is a zero point (an asymmetric scheme); NVFP4 weights are symmetric")
        for suffix in suffixes:
            if key.endswith("." + suffix):
                owner = key.removesuffix(suffix) + nvfp4.CT_PACKED
                if owner not in source:
                    raise DFlashError(f"{model_dir}: {key} has no NVFP4 weight {owner}")
                return key, None
        return None
    allowed = {"modelopt": ("U8",), "modelopt-fp8": ("F8_E4M3",)}.get(fmt, ("U8", "F8_E4M3"))  # (safetensors dtypes)
    what = {"modelopt": "NVFP4", "modelopt-fp8": "FP8"}.get(fmt, "MIXED_PRECISION")
    if key.endswith(".weight") and kinds.get(key) in ("U8", "F8_E4M3"):
        base = key.removesuffix("weight")
        if kinds[key] not in allowed:
            raise DFlashError(f"{model_dir}: weight {key} is {_KIND_NAMES[kinds[key]]} in a ModelOpt {what} checkpoint "
                              f"(its quantized weights are {_KIND_NAMES[allowed[0]]}; a mixed-precision layout?)")
        nvfp4_weight = kinds[key] == "U8"
        needed = (nvfp4.MO_SCALE, nvfp4.MO_SCALE_2) if nvfp4_weight else (nvfp4.MO_SCALE,)
        for suffix in needed:
            if base + suffix not in source:
                raise DFlashError(f"{model_dir}: {'NVFP4' if nvfp4_weight else 'FP8'} weight {key} has no "
                                  f"{base + suffix}")
        t = f.get_tensor(key).to(device)
        if nvfp4_weight:
            scale, scale_2 = part(base + nvfp4.MO_SCALE), part(base + nvfp4.MO_SCALE_2)
            if keep:
                rows = nvfp4.check_parts(t, scale, scale_2, key, base + nvfp4.MO_SCALE, base + nvfp4.MO_SCALE_2)
                return key, kept(key, t, scale, rows, nvfp4.MODELOPT_NVFP4)
            return key, {key: nvfp4.dequantize_modelopt(t, scale, scale_2, dtype, key)}
        if base + nvfp4.MO_SCALE_2 in source:
            raise DFlashError(f"{model_dir}: FP8 weight {key} has a {base + nvfp4.MO_SCALE_2} (an NVFP4 scale); "
                              "ModelOpt's FP8 weights have one per-tensor weight_scale")
        return key, {key: nvfp4.dequantize_modelopt_fp8(t, part(base + nvfp4.MO_SCALE), dtype, key)}
    if key.endswith((".k_scale", ".v_scale")):  # (an FP8 KV cache's scales: the cache stays in the model's dtype)
        if kinds.get(key) != "F32" or f.get_slice(key).get_shape() not in ([], [1]):
            raise DFlashError(f"{model_dir}: {key} is not a per-tensor KV cache scale (float32, one value)")
        return key, None
    for suffix in (nvfp4.MO_SCALE_2, nvfp4.MO_SCALE, nvfp4.MO_INPUT):
        if key.endswith("." + suffix):
            owner = key.removesuffix(suffix) + "weight"
            owners = ("U8",) if suffix == nvfp4.MO_SCALE_2 else allowed
            if kinds.get(owner) not in owners:
                raise DFlashError(f"{model_dir}: {key} is a ModelOpt {what} scale, but "
                                  + (f"{owner} is {_KIND_NAMES.get(kinds[owner], kinds[owner])}, not "
                                     f"{' or '.join(_KIND_NAMES[k] for k in owners)}"
                                     if owner in kinds else f"there is no {owner}"))
            return key, None
    return None


_QUANTIZED_KINDS = ("F8_E4M3", "F8_E5M2", "I8")  # safetensors dtypes of weights whose X.scale is their scale
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # (a routed expert's weight, per expert)


def _deepseek_scale(key: str, kinds: dict[str, str]) -> bool:
    """Whether ``key`` is ``X.scale``, DeepSeek's name for the scale of a quantized
    ``X.weight`` (a float8 or int8 weight in the checkpoint; ``kinds``: name -> safetensors
    dtype), as transformers' FP8 loader and vLLM read it (``X.weight_scale_inv``)."""
    return key.endswith(".scale") and kinds.get(key.removesuffix(".scale") + ".weight") in _QUANTIZED_KINDS


_KIND_NAMES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn",
               "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
               "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
_FLOAT_KINDS = ("F64", "F32", "BF16", "F16")  # (unquantized floating point)


def _check_scale_owner(model_dir: Path, key: str, kinds: dict[str, str], fp4: bool) -> None:
    """Refuse an ``X.scale`` that is not DeepSeek's scale of a quantized ``X.weight``
    (:func:`_deepseek_scale`) but looks like one: beside an ``X.weight`` that is neither
    quantized (float8 / int8) nor floating point (e.g. FP4 bytes stored as uint8), or a float8
    ``X.scale`` (a quantization scale: ue8m0 bytes) with no ``X.weight`` or beside an unquantized one.
    A floating-point ``X.scale`` beside a floating-point ``X.weight`` is an ordinary tensor.

    Raises:
        DFlashError: as above, in one line naming the tensors as the checkpoint names them.
    """
    weight = key.removesuffix(".scale") + ".weight"
    kind, own = kinds.get(weight), kinds.get(key, "")
    if kind in _QUANTIZED_KINDS:
        return
    if kind is not None and kind not in _FLOAT_KINDS:
        formats = "FP8 weights are float8_e4m3fn" + (", FP4 weights int8 (two e2m1 values a byte)" if fp4 else "")
        raise DFlashError(f"{model_dir}: weight {weight} is {_KIND_NAMES.get(kind, kind)} with a scale {key}; "
                          f"quantized {formats}")
    if not own.startswith("F8_"):
        return  # (an ordinary tensor)
    if kind is None:
        raise DFlashError(f"{model_dir}: {key} is a scale ({_KIND_NAMES.get(own, own)}) without its weight {weight}")
    raise DFlashError(f"{model_dir}: {key} is a scale ({_KIND_NAMES.get(own, own)}) beside the unquantized weight "
                      f"{weight} ({_KIND_NAMES.get(kind, kind)}); a scale belongs to a quantized weight")


def _scale_names(key: str, kinds: dict[str, str]) -> list[str]:
    """The scales the checkpoint holds (``kinds``: name -> safetensors dtype) for the weight
    ``key``: ``key + "_scale_inv"`` and, for a quantized ``X.weight`` (:func:`_deepseek_scale`),
    ``X.scale``."""
    from .models import fp8

    names = [key + fp8.SCALE_SUFFIX]
    if key.endswith(".weight") and kinds.get(key) in _QUANTIZED_KINDS:
        names.append(key.removesuffix(".weight") + ".scale")
    return [n for n in names if n in kinds]


def _scale_name(model_dir: Path, key: str, kinds: dict[str, str]) -> str | None:
    """The name of the scale of the weight ``key`` in the checkpoint (:func:`_scale_names`);
    None when it has none.

    Raises:
        DFlashError: both.
    """
    found = _scale_names(key, kinds)
    if len(found) > 1:
        raise DFlashError(f"{model_dir}: weight {key} has two scales, {found[0]} and {found[1]}")
    return found[0] if found else None


def _tensor_dtypes(files: list[Path]) -> dict[str, str]:
    """Each tensor's safetensors dtype (``"F8_E4M3"``, ``"I8"``, ``"BF16"``, ...; headers only)."""
    kinds = {}
    for file in files:
        with _open(file) as f:
            for key in f.keys():
                kinds[key] = f.get_slice(key).get_dtype()
    return kinds


def _packed_int_part(model_dir: Path, key: str, source: dict[str, Path]) -> bool:
    """Whether ``key`` is the scale or shape of a packed integer weight (read with it).

    Raises:
        DFlashError: a scale or shape without its packed weight; a zero point or group index
            (schemes :mod:`~dflash_torch.models.packed_int` does not read).
    """
    from .models import packed_int

    for suffix, what in packed_int.UNSUPPORTED_PARTS.items():
        if key.endswith(".weight" + suffix):
            raise DFlashError(f"{model_dir}: {key} is {what}; dflash-torch reads only symmetric pack-quantized weights "
                              "with groups of consecutive columns")
    for suffix in (packed_int.SCALE, packed_int.SHAPE):
        if key.endswith(".weight" + suffix):
            if key.removesuffix(suffix) + packed_int.PACKED not in source:
                raise DFlashError(f"{model_dir}: {key} has no packed weight {key.removesuffix(suffix) + packed_int.PACKED}")
            return True
    return False


_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                   "float8_e8m0fnu") if hasattr(torch, name))


@contextlib.contextmanager
def _open(file: Path):
    """``safe_open`` of one weight file (CPU tensors).

    Raises:
        DFlashError: a file this process may not read (``cannot read FILE: Permission
            denied``); a file that is not valid safetensors (corrupt or truncated); memory that
            cannot be had while the file is read (mapped, or its tensors allocated: a limit on
            the process's memory such as ``ulimit -v``, or a device out of memory).
    """
    from safetensors import SafetensorError

    try:  # (safe_open reports every failure to open as "No such file or directory")
        open(file, "rb").close()
    except OSError as e:
        raise DFlashError(f"cannot read {file}: {e.strerror}") from None
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise DFlashError(f"{file} is not a valid safetensors file (corrupt or truncated?): {e}") from None
    except (RuntimeError, MemoryError) as e:  # (torch's "unable to mmap", "can't allocate memory", CUDA OOM)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, MemoryError) or "mmap" in text or "allocate" in text:
            raise DFlashError(f"out of memory reading the weights in {file}: {text}") from None
        raise


def tensor_names(model_dir: Path) -> set[str]:
    """The names of a checkpoint's tensors (only the safetensors headers are read).

    Raises:
        DFlashError: as :func:`weight_files`; a file that is not valid safetensors, a tensor
            name in two files.
    """
    return set(_tensor_sources(model_dir, weight_files(model_dir)))


def _tensor_sources(model_dir: Path, files: list[Path]) -> dict[str, Path]:
    """Which of ``files`` holds each tensor (only the headers are read).

    Raises:
        DFlashError: a file that is not valid safetensors, a tensor name in two files.
    """
    source = {}
    for file in files:
        with _open(file) as f:
            for key in f.keys():
                if key in source:  # (which copy wins would depend on the file order)
                    raise DFlashError(f"{model_dir}: weight {key} is in both {source[key].name} and {file.name}")
                source[key] = file
    return source


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """True when every value of the floating-point tensor ``t`` is finite (no NaN, no inf).
    Checked ``chunk`` elements at a time, so a 600M-value embedding needs 16 MB of
    scratch, not 600 MB."""
    parts = t.reshape(-1).split(chunk)
    return bool(torch.stack([torch.isfinite(p).all() for p in parts]).all()) if parts else True


def available_memory(device: str | torch.device) -> int | None:
    """Bytes that new tensors on ``device`` can take now: a CUDA device's free memory
    (``torch.cuda.mem_get_info``); for the CPU the host's available memory (``psutil``:
    free plus reclaimable page cache, without swap) or, when less, what the process's
    memory cgroup still allows (:func:`cgroup_available`: a container's limit, which
    psutil does not see) or its address-space limit leaves (:func:`address_space_left`:
    ``ulimit -v``); None for other devices."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        limits = [psutil.virtual_memory().available, cgroup_available(), address_space_left()]
        return min(n for n in limits if n is not None)
    return None


def address_space_left() -> int | None:
    """Bytes of address space this process may still map under its soft ``RLIMIT_AS``
    (``ulimit -v``; a CPU tensor past it fails to allocate however much memory is free):
    the limit minus the process's virtual size, at least 0; None without a limit (or where
    the platform has none, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - psutil.Process().memory_info().vms)


def memory_text(nbytes: float, binary: bool = False) -> str:
    """``nbytes`` for a message, with one decimal in the largest unit it reaches: ``TB``, ``GB``,
    ``MB`` or ``kB`` (powers of 1000; ``binary``: ``TiB``, ``GiB``, ``MiB``, ``KiB``, powers of
    1024), else ``bytes``: ``42.3 GB``, ``1.4 MB`` (where ``0.0 GB`` said nothing of a small
    model), ``3.1 TB`` (not ``3072.0 GB``)."""
    base, units = (1024, ("KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("kB", "MB", "GB", "TB"))
    for power in (4, 3, 2, 1):
        if abs(nbytes) >= 0.99995 * base ** power:  # (a value that would print as 1000.0 of the unit below)
            return f"{nbytes / base ** power:.1f} {units[power - 1]}"
    return f"{nbytes:.0f} bytes"


def cgroup_available(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the memory cgroups of this process still allow (e.g. ``docker run --memory``):
    at each level from the process's own cgroup up to ``root``, the limit minus the usage
    plus the reclaimable (inactive) file cache; the least of them. Reads cgroup v2
    (``memory.max``, ``memory.current``) or v1 (``memory/memory.limit_in_bytes``,
    ``memory.usage_in_bytes``); levels a container does not show are skipped.

    Returns:
        bytes (>= 0), or None where no level has a limit (or no cgroup is mounted).
    """
    def read(path: Path) -> str | None:
        try:
            return path.read_text()
        except OSError:
            return None

    own = {}  # controller ("" for v2) -> the process's cgroup path
    for line in (read(self_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            for c in fields[1].split(","):
                own[c] = fields[2]
    if (root / "cgroup.controllers").is_file():  # v2: one unified hierarchy
        base, limit_file, usage_file, cache_key = root, "memory.max", "memory.current", "inactive_file"
        path = own.get("", "")
    else:
        base, limit_file, usage_file, cache_key = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        path = own.get("memory", "")
    parts = [p for p in path.split("/") if p]
    levels = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    best = None
    for level in levels:
        limit, usage = read(level / limit_file), read(level / usage_file)
        stat = dict(line.split() for line in (read(level / "memory.stat") or "").splitlines() if line.count(" ") == 1)
        try:
            limit, usage, cache = int(limit), int(usage), int(stat.get(cache_key, 0))
        except (TypeError, ValueError):  # absent, "max" (v2: no limit) or unreadable
            continue
        if limit < 1 << 60:  # v1 writes "no limit" as a number near 2**63
            free = max(0, limit - usage + cache)
            best = free if best is None else min(best, free)
    return best


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``model``'s parameters once loaded: floating-point ones in ``dtype``, others
    (packed MXFP4 blocks and scales: uint8) and those of layers that keep FP8 weights
    (:func:`~dflash_torch.models.fp8.kept_parameters`: e4m3 weights, float32 row scales)
    as they are. Works on the meta device."""
    from .models.fp8 import kept_parameters

    kept = kept_parameters(model)
    return sum(p.numel() * (dtype.itemsize if p.is_floating_point() and id(p) not in kept else p.element_size())
               for p in model.parameters())


def fits(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device, share: float = 1.0,
         saving: int = 0) -> bool:
    """Whether :func:`weight_bytes` of ``model``, less ``saving`` bytes, takes at most
    ``share`` of :func:`available_memory` of ``device`` (True when that is unknown)."""
    free = available_memory(device)
    return free is None or weight_bytes(model, dtype) - saving <= share * free


def check_fits(model: torch.nn.Module, dtype: torch.dtype, device: str | torch.device, what: str,
               saving: int = 0, kept: str = "FP8 weights kept as stored", files: list[int] | None = None) -> None:
    """Refuse to load ``model`` (built on the meta device) when its weights in ``dtype``
    (less ``saving`` bytes: FP8 weights kept as stored, :func:`fp8_saving`, or packed integer
    weights kept packed, :func:`int_saving`; ``kept`` says which in the message) alone exceed
    :func:`available_memory` of ``device``: one clear line instead of an out-of-memory
    error halfway through loading (or, on Linux, the process killed without a word). Under an
    address-space limit (``ulimit -v``: :func:`address_space_left`) the weight ``files``' sizes
    in bytes (:func:`weight_file_sizes`) count too: the largest, as a file is mapped whole while
    it is read, on top of the weights loaded on the CPU, counted at least at the files' size
    (tensors read as stored, then cast, leave their address space taken: a float32 checkpoint
    loaded in bfloat16 needs what it needs in float32); weights that fit failed to map
    ("unable to mmap").

    Raises:
        DFlashError: ``the target needs 42.3 GB for its weights in bfloat16; cuda:0 has 39.5 GB free``
            (:func:`memory_text`: ``MB`` below a GB); ``the target needs 488.7 MB for its weights in
            float32 (488.7 MB of weight files) and 488.7 MB more to map its largest weight file
            while it is read; the address-space limit (ulimit -v) leaves 881.5 MB``.
    """
    need = weight_bytes(model, dtype) - saving
    weights = f"{memory_text(need)} for its weights in {str(dtype).removeprefix('torch.')}{f' ({kept})' if saving else ''}"
    if not fits(model, dtype, device, saving=saving):
        raise DFlashError(f"the {what} needs {weights}; {torch.device(device)} has "
                          f"{memory_text(available_memory(device))} free")
    left = address_space_left()
    if files and left is not None:
        loaded = max(need, sum(files)) if torch.device(device).type == "cpu" else 0
        if max(files) + loaded > left:
            raise DFlashError(f"the {what} needs {weights} ({memory_text(sum(files))} of weight files) and "
                              f"{memory_text(max(files))} more to map its largest weight file while it is read; the "
                              f"address-space limit (ulimit -v) leaves {memory_text(left)}")


def weight_file_sizes(model_dir: Path) -> list[int]:
    """Bytes of each of :func:`weight_files` of ``model_dir`` (safetensors maps a file whole
    while its tensors are read: address space on top of the weights loaded).

    Raises:
        DFlashError: as :func:`weight_files`.
    """
    return [file.stat().st_size for file in weight_files(model_dir)]


def int_saving(model_dir: Path, dtype: torch.dtype, bits: int, group: int | None,
               keep: Callable[[str], bool] | None = None) -> int:
    """Bytes saved by keeping a checkpoint's packed integer weights packed instead of
    dequantizing them into ``dtype``: per ``X.weight_packed`` (that ``keep`` accepts) of
    ``rows`` x ``words``, ``rows * words * 32 / bits`` elements of ``dtype`` less the words
    themselves and the scales as stored (``X.weight_scale``). Reads only the files' headers.

    Raises:
        DFlashError: a weight file that is not valid safetensors.
    """
    from .models import packed_int

    headers = {}  # name -> (shape, dtype) of the packed words and scales (any shard)
    for file in weight_files(model_dir):
        with _open(file) as f:
            for key in f.keys():
                if key.endswith((packed_int.PACKED, ".weight" + packed_int.SCALE)):
                    part = f.get_slice(key)
                    headers[key] = (part.get_shape(), part.get_dtype())
    saved = 0
    for key, (shape, _) in headers.items():
        if not key.endswith(packed_int.PACKED) or len(shape) < 2 or (keep is not None and not keep(key)):
            continue  # (a packed weight that is not a matrix is refused when it is read)
        *lead, rows, words = shape
        saved += math.prod(lead) * rows * (words * 32 // bits * dtype.itemsize - words * 4)
        scale = headers.get(key.removesuffix(packed_int.PACKED) + packed_int.SCALE)
        if scale is not None:
            saved -= math.prod(scale[0]) * _SAFETENSORS_BYTES.get(scale[1], 4)
    return saved


_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}  # (bytes per element of a scale's dtype)


def _headers(model_dir: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every tensor's shape and safetensors dtype (``"F8_E4M3"``, ``"U8"``, ...) by name,
    from the files' headers alone.

    Raises:
        DFlashError: a weight file that is not valid safetensors.
    """
    shapes, kinds = {}, {}
    for file in weight_files(model_dir):
        with _open(file) as f:
            for key in f.keys():
                part = f.get_slice(key)
                shapes[key], kinds[key] = part.get_shape(), part.get_dtype()
    return shapes, kinds


def fp4_saving(model_dir: Path, dtype: torch.dtype, keep: Callable[[str], bool] | None = None) -> int:
    """Bytes saved by keeping a DeepSeek-V4 checkpoint's FP4 experts packed instead of
    dequantizing them into ``dtype``: per int8 ``X.weight`` ``[..., rows, cols / 2]`` with a
    scale (``X.scale`` or ``X.weight_scale_inv``; that ``keep`` accepts), ``rows * cols``
    elements of ``dtype`` less its bytes and its one-byte scales (``rows * cols / 32``).
    Reads only the files' headers.

    Raises:
        DFlashError: a weight file that is not valid safetensors.
    """
    from .models import mxfp4

    shapes, kinds = _headers(model_dir)
    saved = 0
    for key, kind in kinds.items():
        if kind != "I8" or len(shapes[key]) < 2 or (keep is not None and not keep(key)):
            continue
        if not _scale_names(key, kinds):
            continue  # (an int8 weight without a scale is refused when it is read)
        numel = math.prod(shapes[key])  # bytes: two elements each
        saved += 2 * numel * dtype.itemsize - numel - 2 * numel // mxfp4.BLOCK
    return saved


def nvfp4_saving(model_dir: Path, dtype: torch.dtype, fmt: str, keep: Callable[[str], bool] | None = None) -> int:
    """Bytes saved by keeping a checkpoint's NVFP4 weights packed instead of dequantizing them
    into ``dtype`` (``fmt``: :class:`~dflash_torch.models.config.TargetConfig`'s ``nvfp4``):
    per NVFP4 weight (that ``keep`` accepts by its name in the checkpoint: compressed-tensors'
    ``X.weight_packed``, ModelOpt's uint8 ``X.weight``) of ``rows`` x ``cols / 2`` bytes,
    ``rows * cols`` elements of ``dtype`` less what stays held
    (:class:`~dflash_torch.models.nvfp4.Nvfp4Linear`): the bytes, one float8 scale per 16
    columns and a float32 scale per row. ModelOpt's FP8 weights are dequantized: no saving.
    Reads only the files' headers.

    Raises:
        DFlashError: a weight file that is not valid safetensors.
    """
    from .models import nvfp4

    shapes, kinds = _headers(model_dir)
    saved = 0
    for key, shape in shapes.items():
        if fmt == nvfp4.CT_METHOD:
            quantized = key.endswith("." + nvfp4.CT_PACKED)
        else:
            quantized = key.endswith(".weight") and kinds[key] == "U8" and (
                key.removesuffix("weight") + nvfp4.MO_SCALE_2) in kinds
        if not quantized or len(shape) < 2 or (keep is not None and not keep(key)):
            continue
        *lead, rows, half = shape
        cols = 2 * half
        saved += math.prod(lead) * rows * (cols * dtype.itemsize - half - cols // nvfp4.GROUP - 4)
    return saved


def fp8_saving(model_dir: Path, dtype: torch.dtype, block: tuple[int, int],
               keep: Callable[[str], bool] | None = None) -> int:
    """Bytes saved by keeping a checkpoint's FP8 weights as stored instead of dequantizing
    them into ``dtype``: per ``float8_e4m3fn`` tensor ``[..., rows, cols]`` (that ``keep``
    accepts), ``dtype``'s size less 1 byte per element, less its float32 row scales
    (``rows * ceil(cols / bi)`` each). Reads only the files' headers.

    Raises:
        DFlashError: a weight file that is not valid safetensors.
    """
    saved = 0
    for file in weight_files(model_dir):
        with _open(file) as f:
            for key in f.keys():
                if keep is not None and not keep(key):
                    continue
                part = f.get_slice(key)
                shape = part.get_shape()
                if part.get_dtype() == "F8_E4M3" and len(shape) >= 2:
                    numel = math.prod(shape)
                    saved += numel * (dtype.itemsize - 1) - numel // shape[-1] * math.ceil(shape[-1] / block[1]) * 4
    return saved
