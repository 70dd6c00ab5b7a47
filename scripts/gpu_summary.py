"""One summary table of the GPU checks (issue 12's goals) from the bench.json files that
scripts/gpu_check.sh writes. Ratios come from one run each.

A timing that bench flagged unreliable (a loaded machine) is marked UNRELIABLE, the goals
read from it "?", and bench's reason printed under the table.

A result file that cannot be read (not JSON, a key missing) is named in one line on stderr
and its checks are left out of the table, the rest rendered; the script then exits 1, as it
does when OUT_DIR holds none of the result files.

Usage: python scripts/gpu_summary.py OUT_DIR [--bandwidth-tb-s 4.8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PUBLISHED_TAU = {"mean (paper, Qwen3-8B)": 6.49, "MT-Bench": 4.24, "MATH-500": 7.87}
SHAPES = ("qwen3_8b", "qwen35_9b", "gptoss_20b", "gemma_4_31b", "gemma_4_26b_a4b")
RESULTS = ("probe", *SHAPES, "profile", "pair_bf16", "pair_fp32")  # the files gpu_check.sh writes, NAME.json


def mode(report: dict, name: str) -> dict | None:
    return next((m for m in report["modes"] if m["name"] == name), None)


class Summary:
    """The table's rows, gathered one result file at a time: a file that cannot be read, or
    lacks what its checks read, is named on stderr and its rows are left out."""

    def __init__(self, out: Path):
        self.out, self.rows, self.notes, self.found, self.skipped = out, [], [], 0, []

    def load(self, name: str) -> dict | None:
        """``OUT/name.json`` parsed, or None where it is not there or not readable JSON (then named
        on stderr)."""
        path = self.out / f"{name}.json"
        if not path.is_file():
            return None
        self.found += 1
        try:
            report = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return self.bad(name, f"not readable JSON ({exc})")
        return report if isinstance(report, dict) else self.bad(name, "not a JSON object")

    def bad(self, name: str, why: str) -> None:
        print(f"gpu_summary.py: error: {self.out / name}.json: {why}; its checks are skipped", file=sys.stderr)
        self.skipped.append(f"{name}.json")

    def add(self, name: str, checks, *args) -> None:
        """The rows ``checks(report, row, *args)`` adds for ``OUT/name.json`` (and their notes, the
        lines printed under the table), all of them or (a key or entry missing) none. ``ok``: a
        goal met (True), missed (False), not a goal (None) or not known (a timing flagged
        unreliable: "?")."""
        report = self.load(name)
        if report is None:
            return
        rows, notes = [], []

        def row(what, value, goal="", ok=None, note=None):
            rows.append((what, value, goal, "-" if ok is None else ok if isinstance(ok, str) else ("yes" if ok else "NO")))
            if note:
                notes.append(f"{what}: {note}")

        try:
            checks(report, row, *args)
        except KeyError as exc:
            return self.bad(name, f"no key {exc}")
        except (TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
            return self.bad(name, f"unexpected content ({type(exc).__name__}: {exc})")
        self.rows += rows
        self.notes += notes


def probe_checks(probe: dict, row) -> None:
    print(f"device: {probe['device']}, torch {probe['torch']}, CUDA {probe['cuda']}, cuDNN {probe['cudnn']}")


def shapes_checks(shapes: dict, row, bandwidth_tb_s: float) -> None:
    by = {sh["compiled"]: sh for sh in shapes["shapes"]}
    if False not in by:
        raise ValueError("no eager entry (compiled: false) in 'shapes'")
    name = by[False]["shape"]
    # (a mixture of experts reads only the experts its tokens hit: no all-weights floor)
    floor = None if by[False].get("moe") else by[False]["weights_gib"] * 2**30 / (bandwidth_tb_s * 1e12)
    if floor:
        row(f"{name} {by[False]['dtype']} weights / bandwidth floor (ms)", f"{floor * 1e3:.2f}", f"{bandwidth_tb_s} TB/s")
    for compiled, sh in sorted(by.items()):
        tag = "compiled" if compiled else "eager"
        row(f"{name} {tag} step / round / propose (ms)",
            f"{sh['target_step_s'] * 1e3:.2f} / {sh['round_s'] * 1e3:.2f} / {sh['propose_s'] * 1e3:.2f}"
            + (" UNRELIABLE" if sh.get("unreliable") else ""), note=sh.get("unreliable"))  # (bench's words: why)
    if True in by:
        c = by[True]
        mark = " UNRELIABLE" if c.get("unreliable") else ""
        met = lambda ok: "?" if mark else ok  # (a timing flagged unreliable says nothing about a goal)  # noqa: E731
        if floor:
            step = c["target_step_s"] / floor
            row(f"{name} compiled step / floor", f"{step:.2f}{mark}", "<= 1.5", met(step <= 1.5))
        row(f"{name} compiled round / compiled step", f"{c['round_over_step']:.2f}{mark}", "<= 1.15",
            met(c["round_over_step"] <= 1.15))
        eager = c.get("eager_fallbacks", 0)
        row(f"{name} compiled: CUDA graphs skipped, recompiles, steps run eager",
            f"{c['cudagraph_skips']}, {c['recompiles']}, {eager}", "0, 0, 0",
            c["cudagraph_skips"] == 0 and c["recompiles"] == 0 and eager == 0)
        for k, tau in PUBLISHED_TAU.items():
            row(f"PROJECTION: speedup at tau {tau} ({k})", f"{tau * c['target_step_s'] / c['round_s']:.2f}x{mark}",
                "tau x step / round")
    for sw in shapes.get("shape_sweeps", []):
        r = sw["ratio_longest_over_shortest"]["inject"]
        row(f"{sw['shape']} drafter propose {sw['lengths'][-1]} / {sw['lengths'][0]} context (inject, eager)",
            f"{r:.2f}", "<= 1.1", r <= 1.1)


def profile_checks(prof: dict, row) -> None:
    for r in prof["results"]:
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


def pair_checks(rep: dict, row, dtype: str) -> None:
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
        skips = [m["cudagraphs_skipped"] or 0 for m in (cbase, cinject)]  # (None on a CPU)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bandwidth-tb-s", type=float, default=4.8, help="the device's memory bandwidth (H200: 4.8 TB/s)")
    args = ap.parse_args()
    summary = Summary(Path(args.out))
    summary.add("probe", probe_checks)
    for name in SHAPES:
        summary.add(name, shapes_checks, args.bandwidth_tb_s)
    summary.add("profile", profile_checks)
    for dtype in ("bf16", "fp32"):
        summary.add(f"pair_{dtype}", pair_checks, dtype)
    if not summary.found:
        where = "no such folder" if not summary.out.is_dir() else f"looked for {', '.join(n + '.json' for n in RESULTS)}"
        print(f"gpu_summary.py: error: no result files found in {args.out} ({where})", file=sys.stderr)
        sys.exit(1)
    rows = summary.rows
    widths = [max(len(r[i]) for r in rows + [("check", "value", "goal", "met")]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(("check", "value", "goal", "met")))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    for note in summary.notes:
        print(note)
    if summary.skipped:
        print(f"gpu_summary.py: checks skipped (file unreadable or incomplete): {', '.join(summary.skipped)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
