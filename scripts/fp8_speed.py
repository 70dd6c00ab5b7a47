"""Target-only decoding speed of a quantized target (fine-grained FP8, compressed-tensors
W4A16 / W8A16 packed integers, or NVFP4) dequantized when loading vs kept as stored
(``fp8="packed"`` / ``int_weights="packed"`` / ``nvfp4="packed"``: dequantized per forward),
and the memory each takes.

Builds a random checkpoint of the chosen family and width (transformers' own class, the
shipped default tokenizer), quantizes every decoder projection with the test suite's
quantizers (``--format fp8``: FP8 in blocks of 128 x 128 as the official ``*-FP8``
checkpoints do; ``w4a16`` / ``w8a16``: symmetric integers per group of 128 columns, packed
by compressed-tensors; ``nvfp4-ct``: compressed-tensors' own NVFP4 compressor; ``nvfp4-modelopt``:
NVFP4 as ModelOpt writes it), then decodes the same prompt with both modes in one process,
alternating, and prints tokens/s, weight bytes and whether the tokens are the same.

    python scripts/fp8_speed.py --family qwen3 --hidden 1024 --layers 4 --tokens 64 --dtype bfloat16 [--format w4a16]
    python scripts/fp8_speed.py --threads 2 --tokens 32 --format nvfp4-modelopt
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_hybrid_target, make_target  # noqa: E402  (the test suite's checkpoint builders)
from dflash_torch import DFlashEngine  # noqa: E402
from dflash_torch.cli import script_parser  # noqa: E402
from dflash_torch.errors import OptionError  # noqa: E402
from dflash_torch.options import check_threads  # noqa: E402
from mxfp4_speed import check_args, compare, speed_args  # noqa: E402  (its options and timing of the two modes)

TOKENIZER = ROOT / "dflash_torch" / "assets" / "default" / "target"


def main() -> None:
    ap = script_parser(__file__, __doc__)  # (the command line's parser: a usage error is one line)
    ap.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_moe", "qwen3_next"])
    speed_args(ap, "hidden width (a multiple of 128; of 256 for qwen3_next and for qwen3_moe's w4a16 / w8a16, "
                   "whose experts are half as wide, in groups of 128)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--format", default="fp8", choices=["fp8", "w4a16", "w8a16", "nvfp4-ct", "nvfp4-modelopt"])
    args = ap.parse_args()
    wide = args.family == "qwen3_next" or (args.family == "qwen3_moe" and args.format in ("w4a16", "w8a16"))
    check_args(ap, args, 256 if wide else 128)
    if args.threads is not None:
        try:  # (at most the CPUs this process may use, as the command's --threads)
            check_threads(args.threads, "--threads")
        except OptionError as exc:
            ap.error(str(exc))
    # (the test suite's quantizers, imported here: all but fp8's need compressed-tensors, which the
    # fp8 part of scripts/gpu_check.sh does without)
    try:
        if args.format == "fp8":
            from test_fp8 import to_fp8 as quantize
        elif args.format.startswith("nvfp4"):
            from test_nvfp4 import to_ct_nvfp4, to_modelopt
            quantize = to_ct_nvfp4 if args.format == "nvfp4-ct" else to_modelopt
        else:
            from test_packed_int import to_packed as quantize
    except ModuleNotFoundError as exc:
        package = (exc.name or "compressed_tensors").split(".")[0]
        ap.exit(2, f"{ap.prog}: error: --format {args.format} needs the package {package} (pip install "
                   f"{package.replace('_', '-')})\n")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp())
    try:
        vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
        heads = args.hidden // 128  # (key-value heads: a quarter of them, or the nearest divisor below)
        kv = max(d for d in range(1, max(1, heads // 4) + 1) if heads % d == 0)
        shape = dict(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=3 * args.hidden,
                     num_attention_heads=heads, num_key_value_heads=kv, head_dim=128)
        if args.family == "qwen3":
            src = make_target(work / "src", "qwen3", tokenizer=False, **shape)
        else:
            extra = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=args.hidden // 2)
            if args.family == "qwen3_next":
                extra.update(shared_expert_intermediate_size=args.hidden // 2, linear_num_key_heads=args.hidden // 256,
                             linear_num_value_heads=args.hidden // 128, linear_key_head_dim=128, linear_value_head_dim=128)
            src = make_hybrid_target(work / "src", args.family, tokenizer=False, **shape, **extra)
        if args.format == "fp8":
            target = quantize(src, work / "q", (128, 128), suffixes=("_proj.weight", "in_proj_qkvz.weight"))
        elif args.format.startswith("nvfp4"):
            target = quantize(src, work / "q")
        else:
            target = quantize(src, work / "q", 4 if args.format == "w4a16" else 8, 128)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, target / name)
        option = {"fp8": "fp8", "nvfp4-ct": "nvfp4", "nvfp4-modelopt": "nvfp4"}.get(args.format, "int_weights")
        engines = {mode: DFlashEngine.from_pretrained(target, no_draft=True, dtype=args.dtype, device=args.device,
                                                      **{option: mode})
                   for mode in ("dequantize", "packed")}
        compare(engines, args.tokens, args.reps)
        if option == "nvfp4":  # (its lookup tables, built when loading)
            tables = sum(b.numel() * b.element_size() for m in engines["packed"].target.modules()
                         if getattr(m, "nvfp4_kind", 0) for b in m.buffers(recurse=False))
            print(f"packed tables (not in weights): {tables / 1e6:.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
