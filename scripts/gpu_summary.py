"""One summary table of the GPU checks (issue 12's goals) from the bench.json files that
scripts/gpu_check.sh writes. Ratios come from one run each.

Usage: python scripts/gpu_summary.py OUT_DIR [--bandwidth-tb-s 4.8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PUBLISHED_TAU = {"mean (paper, Qwen3-8B)": 6.49, "MT-Bench": 4.24, "MATH-500": 7.87}


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def mode(report: dict, name: str) -> dict | None:
    return next((m for m in report["modes"] if m["name"] == name), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.8, help="the device's memory bandwidth (H200: 4.8 TB/s)")
    args = ap.parse_args()
    out = Path(args.out)
    rows = []

    def row(what, value, goal="", ok=None):
        rows.append((what, value, goal, "-" if ok is None else ("yes" if ok else "NO")))

    probe = load(out / "probe.json")
    if probe:
        print(f"device: {probe['device']}, torch {probe['torch']}, CUDA {probe['cuda']}, cuDNN {probe['cudnn']}")
    for shapes in filter(None, (load(out / "qwen3_8b.json"), load(out / "qwen35_9b.json"), load(out / "gptoss_20b.json"),
                                 load(out / "gemma_4_31b.json"), load(out / "gemma_4_26b_a4b.json"))):
        by = {sh["compiled"]: sh for sh in shapes["shapes"]}
        name = by[False]["shape"]
        # (a mixture of experts reads only the experts its tokens hit: no all-weights floor)
        floor = None if by[False].get("moe") else by[False]["weights_gib"] * 2**30 / (args.bandwidth_tb_s * 1e12)
        if floor:
            row(f"{name} {by[False]['dtype']} weights / bandwidth floor (ms)", f"{floor * 1e3:.2f}", f"{args.bandwidth_tb_s} TB/s")
        for compiled, sh in sorted(by.items()):
            tag = "compiled" if compiled else "eager"
            row(f"{name} {tag} step / round / propose (ms)",
                f"{sh['target_step_s'] * 1e3:.2f} / {sh['round_s'] * 1e3:.2f} / {sh['propose_s'] * 1e3:.2f}")
        if True in by:
            c = by[True]
            if floor:
                row(f"{name} compiled step / floor", f"{c['target_step_s'] / floor:.2f}", "<= 1.5", c["target_step_s"] / floor <= 1.5)
            row(f"{name} compiled round / compiled step", f"{c['round_over_step']:.2f}", "<= 1.15", c["round_over_step"] <= 1.15)
            eager = c.get("eager_fallbacks", 0)
            row(f"{name} compiled: CUDA graphs skipped, recompiles, steps run eager",
                f"{c['cudagraph_skips']}, {c['recompiles']}, {eager}", "0, 0, 0",
                c["cudagraph_skips"] == 0 and c["recompiles"] == 0 and eager == 0)
            for k, tau in PUBLISHED_TAU.items():
                row(f"PROJECTION: speedup at tau {tau} ({k})", f"{tau * c['target_step_s'] / c['round_s']:.2f}x",
                    "tau x step / round")
        for sw in shapes.get("shape_sweeps", []):
            r = sw["ratio_longest_over_shortest"]["inject"]
            row(f"{sw['shape']} drafter propose {sw['lengths'][-1]} / {sw['lengths'][0]} context (inject, eager)",
                f"{r:.2f}", "<= 1.1", r <= 1.1)
    prof = load(out / "profile.json")
    for r in prof["results"] if prof else []:
        tag = f"{r['shape']} compiled, {r.get('variant', 'joined' if r['fused'] else 'separate')}"
        step = r["target_step_s"] / prof["floor_s"]
        row(f"{tag}: step / propose / verify / round (ms)",
            " / ".join(f"{r[k] * 1e3:.2f}" for k in ("target_step_s", "propose_s", "verify_s", "round_s")))
        row(f"{tag}: step / floor", f"{step:.2f}", "<= 1.5", step <= 1.5)
        row(f"{tag}: round / step", f"{r['round_over_step']:.2f}", "<= 1.15", r["round_over_step"] <= 1.15)
        if r.get("floor_round_over_step"):
            row(f"{tag}: round / step implied by the weights read", f"{r['floor_round_over_step']:.2f}")
        s = r["profile"]["step"]
        row(f"{tag}: step kernels, device busy / wall (us)", f"{s['kernels']:.0f}, {s['busy_us']:.0f} / {s['wall_us']:.0f}")
    for dtype in ("bf16", "fp32"):
        rep = load(out / f"pair_{dtype}.json")
        if not rep:
            continue
        base, inject = mode(rep, "target-only"), mode(rep, "inject")
        cbase, cinject = mode(rep, "target-only-compiled"), mode(rep, "inject-compiled")
        for m in rep["modes"]:
            extra = f", tau {m['mean_acceptance_length']:.2f}" if m["name"] not in ("target-only", "target-only-compiled") else ""
            row(f"shipped pair {dtype} {m['name']} (tok/s)", f"{m['decode_tokens_per_second']:.0f}{extra}")
        if base and inject:
            r = inject["decode_tokens_per_second"] / base["decode_tokens_per_second"]
            row(f"shipped pair {dtype}: inject eager / target-only eager", f"{r:.2f}", ">= 1.3", r >= 1.3)
        if cbase and cinject:
            r = cinject["decode_tokens_per_second"] / cbase["decode_tokens_per_second"]
            row(f"shipped pair {dtype}: inject-compiled / target-only-compiled", f"{r:.2f}", ">= 1.5", r >= 1.5)
            skips = [m["cudagraphs_skipped"] for m in (cbase, cinject)]
            rec = [m["recompiles_after_warmup"] for m in (cbase, cinject)]
            eager = sum(m.get("eager_fallbacks") or 0 for m in (cbase, cinject))
            row(f"shipped pair {dtype}: CUDA graphs skipped, recompiles, steps run eager",
                f"{sum(skips)}, {sum(rec)}, {eager}", "0, 0, 0", sum(skips) == 0 and sum(rec) == 0 and eager == 0)
        if rep.get("sweep"):
            r = rep["sweep"]["ratio_longest_over_shortest"]["inject"]
            row(f"shipped drafter propose {rep['sweep']['lengths'][-1]} / {rep['sweep']['lengths'][0]} context (inject)",
                f"{r:.2f}", "<= 1.1", r <= 1.1)
        if dtype == "fp32" and base:
            same = all(m["outputs_identical_to_target_only"] for m in rep["modes"] if m["name"] != "target-only")
            row("shipped pair fp32: every mode identical to target-only", str(same), "True", same)
    widths = [max(len(r[i]) for r in rows + [("check", "value", "goal", "met")]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(("check", "value", "goal", "met")))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    main()
