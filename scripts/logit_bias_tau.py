"""Acceptance length (tau) with a logit bias / min_tokens, the drafter's scores biased or not.

The target's logits always get the bias (that is what keeps decoding lossless); the
drafter's may get it too (``LogitsProcessor.draft_scores``: the default) or not (switched
off here by replacing that method with the identity). Decodes the first prompts of the
shipped pair's held-out set with the shipped target and each of its drafters (DFlash 2, the
default, and DFlash v1), greedy (both ways must give the same tokens) and sampled, and
prints the mean tau and decode tokens/s of each setting both ways.

Settings: a ban (-100) of the 3 tokens most frequent in the unbiased greedy outputs, +100
forcing one token, and min_tokens = max_new_tokens with an EOS pushed up by +5 (the EOS is
masked all along).

    python scripts/logit_bias_tau.py --threads 1 --prompts 4 --max-new-tokens 128
"""

from __future__ import annotations

import json
import statistics
from collections import Counter

import torch

from dflash_torch import DFlashEngine
from dflash_torch.cli import NEEDS_A_ROUND, check_counts, script_errors, script_parser
from dflash_torch.engine import ASSETS
from dflash_torch.options import check_threads
from dflash_torch.sampling import LogitsProcessor


def run(engine, prompts, kw, draft_biased: bool) -> tuple[list[list[int]], float, float]:
    """Token ids, mean tau and median decode tokens/s over ``prompts``."""
    saved = LogitsProcessor.draft_scores
    if not draft_biased:
        LogitsProcessor.draft_scores = lambda self, scores: scores
    try:
        outs = [engine.generate(p, **kw) for p in prompts]
    finally:
        LogitsProcessor.draft_scores = saved
    taus = [t for o in outs for t in o.stats.acceptance_lengths]
    return ([o.token_ids for o in outs], statistics.mean(taus),
            statistics.median(o.stats.decode_tokens_per_second for o in outs))


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``logit_bias_tau.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=2, help="sampled runs per prompt (temperature 0.7)")
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "prompts", "seeds")
        check_counts(args, "max_new_tokens", minimum=2, why=NEEDS_A_ROUND)
        torch.set_num_threads(check_threads(args.threads, "--threads"))
        lines = (ASSETS / "prompts.jsonl").read_text().splitlines()[: args.prompts]
        prompts = [json.loads(line)["prompt"] for line in lines]
        base = dict(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        for drafter in ("drafter", "drafter-dflash1"):
            engine = DFlashEngine.from_pretrained(ASSETS / "target", ASSETS / drafter)
            engine.generate(prompts[0], max_new_tokens=8)  # warm-up
            plain, tau, rate = run(engine, prompts, base, True)
            top = [t for t, _ in Counter(t for out in plain for t in out).most_common(3)]
            settings = {"none": {}, f"ban {top} (-100)": dict(logit_bias={t: -100 for t in top}),
                        f"force {top[0]} (+100)": dict(logit_bias={top[0]: 100}),
                        "min_tokens=all, EOS +5": dict(logit_bias={0: 5}, min_tokens=args.max_new_tokens,
                                                       ignore_eos=False)}
            print(f"{drafter}: unbiased greedy tau {tau:.2f}")
            for name, extra in settings.items():
                for sampled in (False, True):
                    kws = [{**base, **extra}] if not sampled else \
                        [{**base, **extra, "temperature": 0.7, "seed": s} for s in range(args.seeds)]
                    row = {}
                    for biased in (True, False):
                        got = [run(engine, prompts, kw, biased) for kw in kws]
                        row[biased] = ([t for g in got for t in g[0]], statistics.mean(g[1] for g in got),
                                       statistics.median(g[2] for g in got))
                    if not sampled:
                        assert row[True][0] == row[False][0], f"{drafter} {name}: greedy tokens differ"
                    mode = "sampled" if sampled else "greedy"
                    print(f"  {name:32s} {mode:8s} tau drafter biased {row[True][1]:5.2f} / not {row[False][1]:5.2f}"
                          f"   tok/s {row[True][2]:7.1f} / {row[False][2]:7.1f}")


if __name__ == "__main__":
    main()
