"""Locate Hugging Face format checkpoints and read their config and safetensors weights.

A checkpoint is a directory with ``config.json`` and either ``model.safetensors`` or
a sharded set described by ``model.safetensors.index.json``. It may be given as a
local path or as a Hugging Face repo id already in the local cache (resolved with
``huggingface_hub`` offline; nothing is downloaded).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from .errors import DFlashError


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """Return the local directory of a checkpoint.

    Args:
        name_or_path: a local directory, or a Hugging Face repo id present in the
            local Hugging Face cache.

    Raises:
        DFlashError: if it is neither a directory with ``config.json`` nor a cached repo.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DFlashError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return path
    if path.exists():
        raise DFlashError(f"{path} is a file; pass the checkpoint directory")
    name = str(name_or_path)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(repo_id=name, local_files_only=True)
        except Exception:
            local = None
        if local and (Path(local) / "config.json").is_file():
            return Path(local)
        raise DFlashError(f"model {name!r} is not a local directory and is not in the Hugging Face cache (offline)")
    raise DFlashError(f"model directory {name!r} does not exist")


def load_config(model_dir: Path) -> dict:
    """Read ``config.json`` of a checkpoint directory as a dict."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{model_dir}/config.json is not valid JSON: {exc}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or all shards of the index).

    Raises:
        DFlashError: if no safetensors weights are present, or a shard is missing.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise DFlashError(f"{model_dir}: shard(s) listed in model.safetensors.index.json are missing: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise DFlashError(f"{model_dir} has no safetensors weights (model.safetensors or model.safetensors.index.json)")


def load_state_dict(model_dir: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                    keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Load the tensors of a checkpoint, cast to ``dtype``, onto ``device``.

    Args:
        keep: read only the tensors whose name it accepts (the others are never
            materialized); None reads all.

    Raises:
        DFlashError: a weight file that is not valid safetensors (corrupt or truncated).
    """
    from safetensors import SafetensorError

    state = {}
    for file in weight_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if keep is not None and not keep(key):
                        continue
                    t = f.get_tensor(key)
                    state[key] = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
        except SafetensorError as e:
            raise DFlashError(f"{file} is not a valid safetensors file (corrupt or truncated?): {e}") from None
    return state


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """True when every value of the floating-point tensor ``t`` is finite (no NaN, no inf).
    Checked ``chunk`` elements at a time, so a 600M-value embedding needs 16 MB of
    scratch, not 600 MB."""
    parts = t.reshape(-1).split(chunk)
    return bool(torch.stack([torch.isfinite(p).all() for p in parts]).all()) if parts else True
