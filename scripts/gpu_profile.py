"""The step/round profile of scripts/gpu_check.sh: a large shape (default Qwen3-8B, random
weights), compiled as ``--compile`` runs it (CUDA graphs), timed and profiled in a few
variants: the attention and MLP projections joined (the engine's default on CUDA) or
separate, optionally with inductor's coordinate-descent tuning (``+cdt``) or the
``max-autotune`` compile mode (``+max-autotune``: GEMM autotuning, minutes more).

Prints, per variant: step / propose / verify / round (ms), round/step and step over the
bandwidth floor (weight bytes / --bandwidth-tb-s); then where the device time of each
part goes (kernels per call, busy vs wall, by kind, top kernels).

Usage: python scripts/gpu_profile.py [--shape qwen3-8b] [--variants joined,separate,joined+cdt]
                                     [--json OUT.json]
       (DEVICE=cpu and a small --shape check the script itself on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch._dynamo
import torch._inductor.config as inductor_config

from dflash_torch import DFlashError
from dflash_torch.bench.profile import summary_lines
from dflash_torch.bench.shapes import round_vs_step

EXTRAS = ("cdt", "max-autotune")


def parse_variant(text: str) -> tuple[bool, set[str]]:
    base, *extras = text.split("+")
    if base not in ("joined", "separate") or not set(extras) <= set(EXTRAS):
        raise SystemExit(f"gpu_profile.py: unknown variant {text!r}: joined|separate, optionally +{' +'.join(EXTRAS)}")
    return base == "joined", set(extras)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--variants", default="joined,separate")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.8, help="the device's memory bandwidth (H200: 4.8)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = os.environ.get("DEVICE", "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():  # (one line, as scripts/gpu_check.sh's)
        print(f"gpu_profile.py: error: no CUDA device (torch {torch.__version__} sees none); run it on a machine with an "
              "NVIDIA GPU and torch built with CUDA (DEVICE=cpu checks the script on a CPU)", file=sys.stderr)
        sys.exit(2)
    dtype = getattr(torch, args.dtype)
    variants = [(v, *parse_variant(v)) for v in args.variants.split(",")]
    try:
        results = profile_variants(args, variants, dtype, device)
    except DFlashError as exc:  # (an unknown --shape, a shape that cannot fit: one line)
        print(f"gpu_profile.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    report(args, results, device)


def profile_variants(args: argparse.Namespace, variants: list, dtype: torch.dtype, device: str) -> list[dict]:
    """One compiled DFlash round against one target step per variant (:func:`round_vs_step`)."""
    results = []
    for name, fuse, extras in variants:
        torch._dynamo.reset()
        inductor_config.coordinate_descent_tuning = "cdt" in extras
        r = round_vs_step(args.shape, dtype, device, compiled=True, fuse=fuse, profile=True, repeats=args.repeats,
                          compile_mode="max-autotune" if "max-autotune" in extras else None)
        r["variant"] = name
        results.append(r)
        print(f"{args.shape} compiled, {name}: step {r['target_step_s'] * 1e3:.2f} ms, round {r['round_s'] * 1e3:.2f} ms "
              f"(recompiles {r['recompiles']}, CUDA graphs skipped {r['cudagraph_skips']}, "
              f"steps run eager {r['eager_fallbacks']})", flush=True)
    return results


def report(args: argparse.Namespace, results: list[dict], device: str) -> None:
    """The table of ``results`` against the bandwidth floor, the profiles, and ``--json``."""
    floor = results[0]["weights_gib"] * 2**30 / (args.bandwidth_tb_s * 1e12)
    print(f"\n{args.shape} {args.dtype} on {device}, context {results[0]['context']}, B={results[0]['block_size']}; "
          f"bandwidth floor {floor * 1e3:.2f} ms ({results[0]['weights_gib']:.1f} GiB at {args.bandwidth_tb_s} TB/s)")
    print("| variant | step ms | propose ms | verify ms | round ms | round/step | step/floor |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['target_step_s'] * 1e3:.2f} | {r['propose_s'] * 1e3:.2f} | "
              f"{r['verify_s'] * 1e3:.2f} | {r['round_s'] * 1e3:.2f} | {r['round_over_step']:.2f} | "
              f"{r['target_step_s'] / floor:.2f} |")
    for r in results:
        for part in ("step", "propose", "verify", "round"):
            print()
            print("\n".join(summary_lines(f"{part}, {r['variant']}", r["profile"][part])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_s": floor, "bandwidth_tb_s": args.bandwidth_tb_s, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
