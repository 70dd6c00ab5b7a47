"""Target-only decoding speed of a gpt-oss target with its MXFP4 experts dequantized when
loading vs kept packed (dequantized per forward), and the memory each takes.

Builds a random gpt-oss checkpoint (transformers' GptOssForCausalLM, experts replaced by
random MXFP4 blocks, the shipped default tokenizer) of the chosen width, then decodes
the same prompt with ``mxfp4="dequantize"`` and ``mxfp4="packed"`` in one process,
alternating, and prints tokens/s and weight bytes of each.

    python scripts/mxfp4_speed.py --hidden 1024 --experts 16 --layers 4 --tokens 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_gpt_oss_target  # noqa: E402  (the test suite's checkpoint builder)
from dflash_torch import DFlashEngine  # noqa: E402
from dflash_torch.checkpoint import weight_bytes  # noqa: E402
from dflash_torch.cli import script_parser  # noqa: E402
from dflash_torch.options import SUPPORTED_DTYPES  # noqa: E402

TOKENIZER = ROOT / "dflash_torch" / "assets" / "default" / "target"


def speed_args(ap: argparse.ArgumentParser, hidden: str) -> None:
    """The options this script and scripts/fp8_speed.py share (``hidden``: ``--hidden``'s help)."""
    ap.add_argument("--hidden", type=int, default=1024, help=hidden)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--reps", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", *SUPPORTED_DTYPES])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, width: int) -> None:
    """Refuse, in one line (exit 2), what :func:`speed_args`' options cannot run: a width that is
    not a positive multiple of ``width``, no layer, token or run, an unknown device, or CUDA
    where torch sees none (before any checkpoint is built)."""
    if args.hidden < width or args.hidden % width:
        ap.error(f"--hidden must be a positive multiple of {width}, got {args.hidden}")
    for flag in ("layers", "tokens", "reps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():  # (one line, as scripts/gpu_probe.py's)
        print(f"{ap.prog}: error: no CUDA device (torch {torch.__version__} sees none); run it on a machine with an "
              "NVIDIA GPU and torch built with CUDA, or give --device cpu", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    ap = script_parser(__file__, __doc__)  # (the command line's parser: a usage error is one line)
    speed_args(ap, "hidden and expert width (a multiple of 32)")
    ap.add_argument("--experts", type=int, default=16, help="experts per layer, at least 4 (4 chosen per token)")
    args = ap.parse_args()
    check_args(ap, args, 32)
    if args.experts < 4:
        ap.error(f"--experts must be at least 4 (4 chosen per token), got {args.experts}")

    work = Path(tempfile.mkdtemp())
    try:
        vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
        target = make_gpt_oss_target(work / "target", tokenizer=False, mxfp4=True, vocab_size=vocab,
                                     hidden_size=args.hidden, intermediate_size=args.hidden, num_hidden_layers=args.layers,
                                     num_local_experts=args.experts, num_experts_per_tok=4, num_attention_heads=16,
                                     num_key_value_heads=4, head_dim=64, sliding_window=128)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, target / name)
        engines = {mode: DFlashEngine.from_pretrained(target, no_draft=True, dtype=args.dtype, device=args.device,
                                                      mxfp4=mode) for mode in ("dequantize", "packed")}
        compare(engines, args.tokens, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare(engines: dict, tokens: int, reps: int) -> None:
    """Decode the same prompt target-only with each engine (``"dequantize"`` and
    ``"packed"``), alternating ``reps`` times, and print each one's best tokens/s and weight
    bytes, the time ratio and whether the tokens are the same."""
    times = {mode: [] for mode in engines}
    outputs = {}
    for _ in range(reps):
        for mode, engine in engines.items():
            t0 = time.perf_counter()
            out = engine.generate("def fibonacci(n):", max_new_tokens=tokens, ignore_eos=True)
            times[mode].append(time.perf_counter() - t0)
            outputs[mode] = out.token_ids
    dtype = engines["packed"].target.model.embed_tokens.weight.dtype
    for mode, engine in engines.items():
        print(f"{mode:10s} {tokens / min(times[mode]):8.1f} tok/s  weights {weight_bytes(engine.target, dtype) / 1e6:8.1f} MB")
    print(f"packed / dequantize time: {min(times['packed']) / min(times['dequantize']):.2f}x; "
          f"same tokens: {outputs['packed'] == outputs['dequantize']}")


if __name__ == "__main__":
    main()
