"""Target-only decoding speed of an NVFP4 target (compressed-tensors ``nvfp4-pack-quantized``
or ModelOpt NVFP4) dequantized when loading vs kept packed (``nvfp4="packed"``: dequantized
per forward from tables the loader's arithmetic fills), the memory each takes, and whether the tokens are
the same.

Builds a random checkpoint of the chosen family and width (transformers' own class, the
shipped default tokenizer), quantizes every decoder projection with the test suite's
quantizers (``--format ct``: compressed-tensors' own NVFP4 compressor; ``modelopt``: the
format as ModelOpt writes it), then decodes the same prompt with both modes in one process,
alternating, and prints tokens/s, weight bytes, the packed layers' dequantization tables'
bytes and whether the tokens are the same.

    python scripts/nvfp4_speed.py --family qwen3 --hidden 1024 --layers 4 --tokens 64 --dtype bfloat16 [--format modelopt]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import make_hybrid_target, make_target  # noqa: E402  (the test suite's checkpoint builders)
from test_nvfp4 import to_ct_nvfp4, to_modelopt  # noqa: E402  (its NVFP4 quantizers)
from dflash_torch import DFlashEngine  # noqa: E402
from mxfp4_speed import compare  # noqa: E402  (its timing of the two modes)

TOKENIZER = ROOT / "dflash_torch" / "assets" / "default" / "target"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_moe"])
    ap.add_argument("--hidden", type=int, default=1024, help="hidden width (a multiple of 128)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--reps", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--format", default="ct", choices=["ct", "modelopt"])
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp())
    try:
        vocab = json.loads((TOKENIZER / "config.json").read_text())["vocab_size"]
        shape = dict(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                     intermediate_size=3 * args.hidden, num_attention_heads=args.hidden // 128,
                     num_key_value_heads=max(1, args.hidden // 512), head_dim=128)
        if args.family == "qwen3":
            src = make_target(work / "src", "qwen3", tokenizer=False, **shape)
        else:
            src = make_hybrid_target(work / "src", "qwen3_moe", tokenizer=False, **shape, num_experts=16,
                                     num_experts_per_tok=4, moe_intermediate_size=args.hidden // 2)
        target = (to_ct_nvfp4 if args.format == "ct" else to_modelopt)(src, work / "q")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER / name, target / name)
        engines = {mode: DFlashEngine.from_pretrained(target, no_draft=True, dtype=args.dtype, device=args.device,
                                                      nvfp4=mode)
                   for mode in ("dequantize", "packed")}
        compare(engines, args.tokens, args.reps)
        tables = sum(b.numel() * b.element_size() for m in engines["packed"].target.modules()
                     if getattr(m, "nvfp4_kind", 0) for b in m.buffers(recurse=False))
        print(f"packed tables (not in weights): {tables / 1e6:.1f} MB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
