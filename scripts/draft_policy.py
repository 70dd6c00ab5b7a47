#!/usr/bin/env python
"""Decode speed of ``--streams`` sequences at a time with each kind of round choice:
always draft, ``draft_max_batch_size="auto"`` (:class:`~dflash_torch.draft_policy.DraftPolicy`),
and batched target-only decoding (no drafter).

``--requests`` greedy requests (the shipped prompts, cycled), ``--new-tokens`` each, go
through a :class:`~dflash_torch.batch.BatchDecoder` of ``--streams`` slots as the server
runs them (a request joins as soon as a slot is free). It prints the decode tokens per
second of each mode (decode rounds only, prefills excluded), its ratio to target-only,
and each run's decode rounds without drafts (none of ``draft``'s, all of target-only's, those
``auto`` chose); all modes must give the same tokens. ``--reps``
repetitions alternate the modes' order; the best of each is reported.

    python scripts/draft_policy.py --threads 1 --streams 4
"""

from __future__ import annotations

import sys
import time

from batching_common import add_common_args, load_engine, shipped_prompts, write_json

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cli import NEEDS_A_ROUND, check_counts, script_errors, script_parser

MODES = ("draft", "auto", "target-only")


def run(engine, prompts: list[list[int]], mode: str, streams: int, requests: int, new_tokens: int) -> dict:
    """All requests through a fresh decoder in ``mode`` -> tok/s, outputs, decode rounds and
    those of them without drafts (target-only decoding has no drafter: all of them)."""
    drafter = None if mode == "target-only" else engine.drafter
    batch = BatchDecoder(engine.target, drafter, max_batch_size=streams, reuse_prefix=False,
                         max_context=max(map(len, prompts)) + new_tokens + 1,
                         draft_max_batch_size="auto" if mode == "auto" else None)
    queue, out, decode_s, tokens, steps = list(range(requests)), {}, 0.0, 0, 0
    while queue or batch.seq_ids or batch._joining:
        while queue and batch.free_slots:
            k = queue.pop(0)
            batch.join(k, prompts[k % len(prompts)], SamplingParams(), new_tokens)
            out[k] = []
        t0 = time.perf_counter()
        rounds = batch.step()
        dt = time.perf_counter() - t0
        decoded = [r for r in rounds.values() if r.acceptance_length is not None]
        if decoded:
            decode_s, steps = decode_s + dt, steps + 1
            tokens += sum(len(r.tokens) for r in decoded)
        for sid, r in rounds.items():
            out[sid] += r.tokens
        for sid in batch.seq_ids:
            if len(out[sid]) >= new_tokens:
                batch.remove(sid)
    return {"tokens_per_second": tokens / decode_s, "rounds": steps,
            "target_only_rounds": steps if drafter is None else batch.target_only_rounds,
            "outputs": {k: v[:new_tokens] for k, v in out.items()}}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``draft_policy.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--streams", type=int, default=4, help="sequences decoded together (slots)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    add_common_args(ap, pair=True)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "streams", "requests")
        check_counts(args, "new_tokens", minimum=2, why=NEEDS_A_ROUND)
        engine = load_engine(args)
    prompts = shipped_prompts(engine)
    results = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            r = run(engine, prompts, mode, args.streams, args.requests, args.new_tokens)
            results[mode].append(r)
            print(f"rep {rep} {mode:11}: {r['tokens_per_second']:6.1f} tok/s, rounds without drafts "
                  f"{r['target_only_rounds']} of {r['rounds']}", flush=True)
    same = all(r["outputs"] == results["target-only"][0]["outputs"] for rs in results.values() for r in rs)
    best = {m: max(r["tokens_per_second"] for r in rs) for m, rs in results.items()}
    print(f"\n{args.streams} streams, {args.requests} requests of {args.new_tokens} tokens; best of {args.reps}:")
    for m in MODES:
        print(f"  {m:11}: {best[m]:6.1f} tok/s, {best[m] / best['target-only']:.2f}x target-only")
    print(f"  outputs identical across modes and reps: {same}")
    with script_errors(ap, args):
        write_json(args, {"tokens_per_second": best, "identical": same})
    if not same:
        sys.exit("the modes gave different tokens")


if __name__ == "__main__":
    main()
