"""Acceptance length (tau) and decode speed under structured outputs, drafts guided by the
grammar or not.

The target's logits are always masked by the constraint (that keeps decoding lossless);
the drafter's slots are chosen among the tokens the grammar allows after the drafts before
them (``LogitsProcessor.choose_draft`` with the guide: the default) or not (the guide
switched off here: the drafter proposes freely and the masked target rejects what the
grammar refuses). Decodes the first prompts of the shipped pair's held-out set with the
shipped target and each of its drafters (DFlash 2, the default, and DFlash v1), greedy,
and prints the mean tau and median decode tokens/s of each setting, whether both ways gave
the same tokens and whether those equal constrained target-only decoding (and its speed).

Constraints: a regex of Python lines (the code model's own kind of text) and a JSON schema
(an object of a name and a list of integers; not text this model was trained on).

    python scripts/structured_tau.py --threads 1 --prompts 4 --max-new-tokens 128
"""

from __future__ import annotations

import json
import statistics

import torch

from dflash_torch import DFlashEngine
from dflash_torch.cli import NEEDS_A_ROUND, check_counts, script_errors, script_parser
from dflash_torch.engine import ASSETS
from dflash_torch.options import check_threads
from dflash_torch.sampling import LogitsProcessor

CONSTRAINTS = {
    "regex (Python lines)": {"regex": r"(    [A-Za-z_][A-Za-z0-9_.]*( = | == |\(|\.)[^\n]{0,60}\n){1,12}"},
    "json schema": {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                             "sizes": {"type": "array", "items": {"type": "integer"},
                                                                       "maxItems": 8}},
                             "required": ["name", "sizes"], "additionalProperties": False}},
}


def run(engine, prompts, kw, guided: bool) -> tuple[list[list[int]], float, float]:
    """Token ids, mean tau and median decode tokens/s over ``prompts``."""
    saved = LogitsProcessor.choose_draft
    if not guided:
        LogitsProcessor.choose_draft = lambda self, drafter, scores, params, gen: drafter.choose_draft(
            self.draft_scores(scores), params, gen)
    try:
        outs = [engine.generate(p, **kw) for p in prompts]
    finally:
        LogitsProcessor.choose_draft = saved
    taus = [t for o in outs for t in o.stats.acceptance_lengths]
    speed = statistics.median(o.stats.generated_tokens / o.stats.decode_time for o in outs if o.stats.decode_time > 0)
    return [o.token_ids for o in outs], sum(taus) / len(taus), speed


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``structured_tau.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "prompts")
        check_counts(args, "max_new_tokens", minimum=2, why=NEEDS_A_ROUND)
        torch.set_num_threads(check_threads(args.threads, "--threads"))
        lines = (ASSETS / "prompts.jsonl").read_text().splitlines()[:args.prompts]
        prompts = [json.loads(line)["prompt"] for line in lines]
        target_only = DFlashEngine.from_pretrained(no_draft=True, dtype="float32")
        for drafter in ("drafter", "drafter-dflash1"):
            engine = DFlashEngine.from_pretrained(ASSETS / "target", ASSETS / drafter, dtype="float32")
            engine.generate(prompts[0], max_new_tokens=16)  # (warm-up)
            free_ids, free_tau, free_speed = run(engine, prompts, dict(max_new_tokens=args.max_new_tokens), True)
            print(f"{drafter}: no constraint: tau {free_tau:.2f}, {free_speed:.0f} tok/s")
            for name, spec in CONSTRAINTS.items():
                kw = dict(max_new_tokens=args.max_new_tokens, structured_output=spec)
                refs = [target_only.generate(p, **kw) for p in prompts]
                ref = [o.token_ids for o in refs]
                t_speed = statistics.median(o.stats.generated_tokens / o.stats.decode_time for o in refs)
                g_ids, g_tau, g_speed = run(engine, prompts, kw, True)
                u_ids, u_tau, u_speed = run(engine, prompts, kw, False)
                print(f"{drafter}: {name}: guided drafts tau {g_tau:.2f}, {g_speed:.0f} tok/s; unguided tau {u_tau:.2f}, "
                      f"{u_speed:.0f} tok/s; same tokens both ways: {g_ids == u_ids}; "
                      f"== constrained target-only ({t_speed:.0f} tok/s): {g_ids == ref}")


if __name__ == "__main__":
    main()
