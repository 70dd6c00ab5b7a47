#!/usr/bin/env python
"""How long running streams stall while a long prompt joins the batch: whole prefill at
once (``BatchDecoder.add``) against chunked prefill between rounds (``BatchDecoder.join``).

``--streams`` short requests (the first prompts of the shipped ``prompts.jsonl``) decode
greedily in a :class:`~dflash_torch.batch.BatchDecoder`; after ``--join-after`` rounds a
long prompt (the shipped prompts concatenated, cut to ``--long-tokens`` tokens) joins and
generates ``--long-new-tokens`` tokens. For each mode it prints the gaps between
consecutive rounds of the short streams (the longest and the median, over the whole run),
the long request's time to first token from its arrival, and the throughput (all
generated tokens over the wall time, the long prompt's prefill included). Both modes must
give the same tokens. ``--reps`` repetitions alternate which mode runs first.

    python scripts/prefill_stalls.py --threads 1                 # shipped pair, float32
    python scripts/prefill_stalls.py --threads 1 --prefill-budget 512
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from batching_common import (
    add_common_args,
    load_engine,
    shipped_prompts,
    shipped_tokens,
    write_json,
)

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cli import NEEDS_A_ROUND, check_counts, script_errors, script_parser


def run(batch: BatchDecoder, shorts: list[list[int]], long_ids: list[int], mode: str, short_new: int, long_new: int,
        join_after: int) -> dict:
    """One run: the short streams decode, the long prompt joins after ``join_after`` rounds
    (``mode`` "add" or "join"); until every request has its tokens."""
    greedy = SamplingParams()
    out = {i: list(batch.add(i, p, greedy, short_new).tokens) for i, p in enumerate(shorts)}
    budgets = {i: short_new for i in out} | {"long": long_new}
    t_start = time.perf_counter()
    last = {i: t_start for i in out}
    gaps, rounds, arrived, ttft = [], 0, None, None
    while arrived is None or batch.seq_ids:
        if rounds == join_after and arrived is None:
            arrived = time.perf_counter()
            if mode == "add":
                out["long"] = list(batch.add("long", long_ids, greedy, long_new).tokens)
                ttft = time.perf_counter() - arrived
            else:
                batch.join("long", long_ids, greedy, long_new)
                out["long"] = []
        step = batch.step()
        now = time.perf_counter()
        rounds += 1
        for sid, rnd in step.items():
            out[sid] += rnd.tokens
            if sid == "long" and rnd.acceptance_length is None:
                ttft = now - arrived
            elif sid != "long":
                gaps.append(now - last[sid])
                last[sid] = now
        for sid in batch.seq_ids:
            if len(out[sid]) >= budgets[sid]:
                batch.remove(sid)
    wall = time.perf_counter() - t_start
    tokens = {sid: t[:budgets[sid]] for sid, t in out.items()}
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_ttft_s": ttft,
            "tokens_per_second": sum(map(len, tokens.values())) / wall, "wall_s": wall, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``prefill_stalls.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--streams", type=int, default=2, help="short streams decoding when the long prompt joins")
    ap.add_argument("--short-new-tokens", type=int, default=256)
    ap.add_argument("--long-tokens", type=int, default=2000, help="tokens of the joining prompt")
    ap.add_argument("--long-new-tokens", type=int, default=64)
    ap.add_argument("--join-after", type=int, default=5, help="rounds of the short streams before the long prompt joins")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prefill-budget", type=int, default=None, help="prompt tokens prefilled per step (default: one chunk)")
    add_common_args(ap)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "streams", "long_tokens", "long_new_tokens", "prefill_chunk", "prefill_budget")
        check_counts(args, "short_new_tokens", minimum=2, why=NEEDS_A_ROUND)
        check_counts(args, "join_after", minimum=0)  # (0: the long prompt joins before the first round)
        engine = load_engine(args)
        shorts = shipped_prompts(engine)[:args.streams]
        long_ids = shipped_tokens(engine, args.long_tokens)
        context = max(map(len, shorts + [long_ids])) + max(args.short_new_tokens, args.long_new_tokens) + 1
        # (reuse_prefix off: every rep reads the same long prompt, which a retained prefix would spare)
        batch = BatchDecoder(engine.target, engine.drafter, max_batch_size=args.streams + 1, max_context=context,
                             prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget, reuse_prefix=False)
        with torch.inference_mode():
            # warm-up (new tokens within those the context was sized for)
            run(batch, shorts, long_ids[:300], "join", min(16, args.short_new_tokens), min(8, args.long_new_tokens), 1)
            results = {"add": [], "join": []}
            for rep in range(args.reps):
                for mode in (("add", "join") if rep % 2 == 0 else ("join", "add")):
                    r = run(batch, shorts, long_ids, mode, args.short_new_tokens, args.long_new_tokens, args.join_after)
                    results[mode].append(r)
                    print(f"rep {rep} {mode:4}: longest gap {r['max_gap_s'] * 1000:7.1f} ms, median gap "
                          f"{r['median_gap_s'] * 1000:6.1f} ms, long TTFT {r['long_ttft_s']:.2f} s, "
                          f"{r['tokens_per_second']:6.1f} tok/s", flush=True)
        same = all(r["tokens"] == results["add"][0]["tokens"] for rs in results.values() for r in rs)
        print(f"\n{args.streams} short streams of {args.short_new_tokens} tokens; a {len(long_ids)}-token prompt joins "
              f"after {args.join_after} rounds ({args.long_new_tokens} tokens); prefill chunk {args.prefill_chunk}, "
              f"budget {batch.prefill_budget}; {args.dtype}, {torch.get_num_threads()} thread(s); medians of {args.reps}:")
        summary = {}
        for mode, label in (("add", "whole prefill (add)"), ("join", "chunked prefill (join)")):
            med = {k: statistics.median(r[k] for r in results[mode])
                   for k in ("max_gap_s", "median_gap_s", "long_ttft_s", "tokens_per_second")}
            summary[mode] = med
            print(f"  {label:24}: longest gap {med['max_gap_s'] * 1000:7.1f} ms, median gap {med['median_gap_s'] * 1000:6.1f} ms, "
                  f"long TTFT {med['long_ttft_s']:.2f} s, {med['tokens_per_second']:6.1f} tok/s")
        print(f"  outputs identical across modes and reps: {same}")
        write_json(args, {"summary": summary, "identical": same,
                          "runs": {m: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for m, rs in results.items()}})
        if not same:
            sys.exit("the two modes gave different tokens")


if __name__ == "__main__":
    main()
