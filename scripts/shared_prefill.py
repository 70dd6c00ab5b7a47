#!/usr/bin/env python
"""The ``n`` choices of one request: one shared prefill (``BatchDecoder(share_prefill=True)``,
the default) against a prefill per choice (``share_prefill=False``, as before).

``--n`` choices of one long prompt (the shipped ``prompts.jsonl`` concatenated, cut to
``--prompt-tokens`` tokens) join an empty :class:`~dflash_torch.batch.BatchDecoder` at
once, as the server admits a request's choices, each sampled with its derived seed
(:func:`~dflash_torch.serving.scheduler.choice_seed`, ``--temperature 0`` for greedy),
and decode ``--new-tokens`` tokens each. For each mode it prints the time from the join to
the last choice's first token, the wall time until every choice has its tokens, and the
prompt tokens the target read. Both modes must give the same tokens. ``--reps``
repetitions alternate which mode runs first; medians are reported.

    python scripts/shared_prefill.py --threads 1                  # shipped pair, float32, n=4
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from batching_common import add_common_args, load_engine, shipped_tokens, write_json

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cli import check_counts, script_errors, script_parser  # noqa: E402
from dflash_torch.serving.scheduler import choice_seed  # noqa: E402


def run(batch: BatchDecoder, prompt: list[int], params: list[SamplingParams], new_tokens: int) -> dict:
    """The choices join at once and decode to ``new_tokens`` each -> times, prompt tokens read, tokens."""
    read = batch.prefill_tokens
    t0 = time.perf_counter()
    for j, p in enumerate(params):
        batch.join(j, prompt, p, new_tokens)
    out: dict[int, list[int]] = {}
    last_first = None
    while batch.seq_ids:
        for j, rnd in batch.step().items():
            out.setdefault(j, []).extend(rnd.tokens)
        if last_first is None and len(out) == len(params):
            last_first = time.perf_counter() - t0
        for j in batch.seq_ids:
            if len(out.get(j, [])) >= new_tokens:
                batch.remove(j)
    return {"last_first_token_s": last_first, "wall_s": time.perf_counter() - t0,
            "prompt_tokens_read": batch.prefill_tokens - read, "tokens": [out[j][:new_tokens] for j in range(len(params))]}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``shared_prefill.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--n", type=int, default=4, help="choices of the request")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per choice")
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    add_common_args(ap)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "n", "prompt_tokens", "new_tokens", "prefill_chunk")
        engine = load_engine(args)
        prompt = shipped_tokens(engine, args.prompt_tokens)
        params = [SamplingParams(temperature=args.temperature, seed=choice_seed(args.seed, j)) for j in range(args.n)]
        batches = {share: BatchDecoder(engine.target, engine.drafter, max_batch_size=args.n,
                                       max_context=len(prompt) + args.new_tokens, prefill_chunk=args.prefill_chunk,
                                       share_prefill=share, reuse_prefix=False)  # (reps repeat the prompt)
                   for share in (True, False)}
        labels = {True: "shared prefill", False: "prefill per choice"}
        with torch.inference_mode():
            for batch in batches.values():
                run(batch, prompt[:300], params, min(8, args.new_tokens))  # warm-up
            results = {True: [], False: []}
            for rep in range(args.reps):
                for share in ((True, False) if rep % 2 == 0 else (False, True)):
                    r = run(batches[share], prompt, params, args.new_tokens)
                    results[share].append(r)
                    print(f"rep {rep} {labels[share]:18}: last choice's first token {r['last_first_token_s']:6.2f} s, "
                          f"wall {r['wall_s']:6.2f} s, prompt tokens read {r['prompt_tokens_read']}", flush=True)
        same = all(r["tokens"] == results[True][0]["tokens"] for rs in results.values() for r in rs)
        print(f"\nn={args.n} choices of a {len(prompt)}-token prompt, {args.new_tokens} tokens each, temperature "
              f"{args.temperature}; prefill chunk {args.prefill_chunk}; {args.dtype}, {torch.get_num_threads()} thread(s); "
              f"medians of {args.reps}:")
        summary = {}
        for share in (False, True):
            med = {k: statistics.median(r[k] for r in results[share]) for k in ("last_first_token_s", "wall_s")}
            med["prompt_tokens_read"] = results[share][0]["prompt_tokens_read"]
            summary[labels[share]] = med
            print(f"  {labels[share]:18}: last choice's first token {med['last_first_token_s']:6.2f} s, "
                  f"wall {med['wall_s']:6.2f} s, prompt tokens read {med['prompt_tokens_read']}")
        print(f"  outputs identical across modes and reps: {same}")
        write_json(args, {"summary": summary, "identical": same,
                          "runs": {labels[s]: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                                   for s, rs in results.items()}})
        if not same:
            sys.exit("the two modes gave different tokens")


if __name__ == "__main__":
    main()
