"""The step/round profile of scripts/gpu_check.sh: a large shape (default Qwen3-8B, random
weights), compiled as ``--compile`` runs it (CUDA graphs), timed and profiled with the
attention and MLP projections joined (the engine's default on CUDA) and separate.

Prints, per variant: step / propose / verify / round (ms), round/step and step over the
bandwidth floor (weight bytes / --bandwidth-tb-s); then, for each, where the device time
of a step and of a round goes (kernels per call, busy vs wall, by kind, top kernels).

Usage: python scripts/gpu_profile.py [--shape qwen3-8b] [--fuse both|on|off] [--json OUT.json]
       (DEVICE=cpu and a small --shape check the script itself on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from dflash_torch.bench.profile import summary_lines
from dflash_torch.bench.shapes import round_vs_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--fuse", default="both", choices=["both", "on", "off"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.8, help="the device's memory bandwidth (H200: 4.8)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = os.environ.get("DEVICE", "cuda")
    dtype = getattr(torch, args.dtype)
    variants = {"both": (False, True), "on": (True,), "off": (False,)}[args.fuse]
    results = []
    for fuse in variants:
        r = round_vs_step(args.shape, dtype, device, compiled=True, fuse=fuse, profile=True, repeats=args.repeats)
        results.append(r)
        print(f"{args.shape} compiled, projections {'joined' if r['fused'] else 'separate'}: "
              f"step {r['target_step_s'] * 1e3:.2f} ms, round {r['round_s'] * 1e3:.2f} ms "
              f"(recompiles {r['recompiles']}, CUDA graphs skipped {r['cudagraph_skips']})", flush=True)
    floor = results[0]["weights_gib"] * 2**30 / (args.bandwidth_tb_s * 1e12)
    print(f"\n{args.shape} {args.dtype} on {device}, context {results[0]['context']}, B={results[0]['block_size']}; "
          f"bandwidth floor {floor * 1e3:.2f} ms ({results[0]['weights_gib']:.1f} GiB at {args.bandwidth_tb_s} TB/s)")
    print("| projections | step ms | propose ms | verify ms | round ms | round/step | step/floor |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'joined' if r['fused'] else 'separate'} | {r['target_step_s'] * 1e3:.2f} | {r['propose_s'] * 1e3:.2f} | "
              f"{r['verify_s'] * 1e3:.2f} | {r['round_s'] * 1e3:.2f} | {r['round_over_step']:.2f} | "
              f"{r['target_step_s'] / floor:.2f} |")
    for r in results:
        for part in ("step", "propose", "verify", "round"):
            print()
            print("\n".join(summary_lines(f"{part}, projections {'joined' if r['fused'] else 'separate'}",
                                          r["profile"][part])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floor_s": floor, "bandwidth_tb_s": args.bandwidth_tb_s, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
