#!/usr/bin/env python
"""Measure a target + drafter pair on the held-out prompts: acceptance length tau
(mean and histogram) and token-for-token identity with target-only decoding.

Greedy, float32, ``--max-new-tokens`` (default 256) with ``ignore_eos=True`` so every
prompt generates the same number of tokens. Writes a JSON report. A tau is null where no
decoding round ran (``--max-new-tokens 1``: the one token comes from the prefill);
``mean_tau_per_prompt`` is over the prompts that ran one.

    python scripts/eval_default_pair.py --out /tmp/eval.json
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from collections import Counter

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dflash_torch import DFlashEngine  # noqa: E402
from dflash_torch.bench.modes import load_prompts  # noqa: E402
from dflash_torch.cli import check_counts, check_out_file, script_errors, script_parser, write_out_file  # noqa: E402
from dflash_torch.options import check_threads  # noqa: E402

DEFAULT = REPO / "dflash_torch" / "assets" / "default"


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value or a prompt file
    or ``--out`` that cannot be used ends it with one line ``eval_default_pair.py: error: ...``
    on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--target", default=str(DEFAULT / "target"))
    ap.add_argument("--draft", default=str(DEFAULT / "drafter"))
    ap.add_argument("--prompts", default=str(DEFAULT / "prompts.jsonl"), help="JSONL file of {\"prompt\": ...} lines")
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=None, help="tokens per draft block (default: the drafter's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", "--num-threads", type=int, default=None,
                    help="CPU threads for torch, at most the CPUs this process may use (default: torch's choice)")
    ap.add_argument("--no-identity", action="store_true", help="skip the target-only comparison")
    ap.add_argument("--out", default=None, help="JSON report path")
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        run(args)


def run(args) -> None:
    """The evaluation of main's options ``args``.

    Raises:
        DFlashError: an option's value, a prompt file or checkpoint that cannot be read, an
            ``--out`` that cannot be written.
    """
    check_counts(args, "num_prompts", "max_new_tokens")
    check_out_file(args.out, "--out")
    if args.threads is not None:
        torch.set_num_threads(check_threads(args.threads, "--threads"))
    texts = load_prompts(args.prompts, args.num_prompts)  # (checks the file: one line for a bad one)
    records = [] if args.prompts == "-" else [  # (their ids and modules; load_prompts read stdin's)
        json.loads(line) for line in pathlib.Path(args.prompts).read_text(encoding="utf-8-sig").splitlines()
        if line.strip()][:len(texts)]
    records += [{}] * (len(texts) - len(records))
    prompts = [{"prompt": text, "id": rec.get("id", f"prompt {i + 1}"), "module": rec.get("module")}
               for i, (text, rec) in enumerate(zip(texts, records))]
    spec = DFlashEngine.from_pretrained(args.target, args.draft, dtype=args.dtype, block_size=args.block_size)
    base = None if args.no_identity else DFlashEngine.from_pretrained(args.target, dtype=args.dtype, no_draft=True)
    hist: Counter = Counter()
    per_prompt, mismatches = [], []
    t0 = time.time()
    for i, rec in enumerate(prompts):
        out = spec.generate(rec["prompt"], max_new_tokens=args.max_new_tokens, ignore_eos=True)
        hist.update(out.stats.acceptance_lengths)
        rounds = len(out.stats.acceptance_lengths)  # (none with 1 new token: it comes from the prefill)
        row = {"id": rec["id"], "module": rec["module"],
               "tau": round(out.stats.mean_acceptance_length, 3) if rounds else None,
               "rounds": rounds, "tokens": len(out.token_ids)}
        if base is not None:
            ref = base.generate(rec["prompt"], max_new_tokens=args.max_new_tokens, ignore_eos=True)
            same = ref.token_ids == out.token_ids
            row["identical"] = same
            if not same:
                first = next((j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)) if a != b),
                             min(len(ref.token_ids), len(out.token_ids)))
                mismatches.append({"id": rec["id"], "first_divergence": first})
        per_prompt.append(row)
        print(f"[{i + 1}/{len(prompts)}] {rec['id']} tau " + ("-" if row["tau"] is None else f"{row['tau']:.2f}")
              + (f" identical={row.get('identical')}" if base is not None else ""), file=sys.stderr, flush=True)
    rounds = sum(hist.values())
    taus = [r["tau"] for r in per_prompt if r["tau"] is not None]  # (those that ran a round)
    report = {
        "target": args.target, "draft": args.draft, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "block_size": spec.block_size, "dtype": args.dtype, "greedy": True, "ignore_eos": True,
        "mean_tau": round(sum(k * v for k, v in hist.items()) / rounds, 3) if rounds else None,  # (1 token: none)
        "mean_tau_per_prompt": round(sum(taus) / len(taus), 3) if taus else None,
        "histogram": {str(k): hist[k] for k in sorted(hist)},
        "identical": None if base is None else not mismatches, "mismatches": mismatches,
        "wall_s": round(time.time() - t0, 1), "per_prompt": per_prompt,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        write_out_file(args.out, text + "\n")
    summary = {k: report[k] for k in ("mean_tau", "mean_tau_per_prompt", "histogram", "identical", "wall_s")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
