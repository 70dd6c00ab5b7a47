#!/usr/bin/env python
"""Decode speed with and without token log-probabilities (``logprobs=k``).

Runs the same prompts (the shipped ``prompts.jsonl``) through ``DFlashEngine.generate``
(one sequence) and ``generate_batch`` (the batch decoder) with ``logprobs`` None, 0 and
``--top`` alternatives, greedy, ``--new-tokens`` each with EOS ignored; the modes alternate
per prompt within each of ``--reps`` repetitions, and the median and best decode tokens/s are reported
(``GenerationStats.decode_tokens_per_second``: tokens after the first over the rounds'
time). Every mode must give the same tokens.

    python scripts/logprobs_overhead.py --threads 1     # shipped pair, float32
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dflash_torch import DFlashEngine  # noqa: E402
from dflash_torch.bench.modes import load_prompts  # noqa: E402
from dflash_torch.engine import ASSETS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = DFlashEngine.from_pretrained(max_batch_size=args.prompts)
    prompts = load_prompts(ASSETS / "prompts.jsonl", args.prompts)
    modes = [None, 0, args.top]
    kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(prompts[0], **kw)  # (warm-up)
    single = {m: [] for m in modes}
    batched = {m: [] for m in modes}
    for rep in range(args.reps):
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]  # (who runs first rotates)
        runs = {m: [] for m in modes}
        for p in prompts:  # modes interleaved per prompt: a slow spell of a shared machine hits all alike
            for m in order:
                runs[m].append(engine.generate(p, logprobs=m, **kw))
        for m in modes:
            assert [o.token_ids for o in runs[m]] == [o.token_ids for o in runs[None]], "logprobs changed the tokens"
            single[m].append(sum(o.stats.generated_tokens - 1 for o in runs[m]) / sum(o.stats.decode_time for o in runs[m]))
        for m in order:
            outs = engine.generate_batch(prompts, logprobs=m, **kw)
            assert [o.token_ids for o in outs] == [o.token_ids for o in runs[None]], "logprobs changed the tokens"
            # (each result's decode_time counts the rounds it was in: the batch's wall time is the longest)
            batched[m].append(sum(o.stats.generated_tokens - 1 for o in outs) / max(o.stats.decode_time for o in outs))
    print(f"shipped pair, float32, {args.threads} thread(s), {len(prompts)} prompts x {args.new_tokens} tokens, "
          f"medians of {args.reps}")
    for name, table in (("generate (one sequence at a time)", single), (f"generate_batch ({len(prompts)} at once)", batched)):
        base = statistics.median(table[None])
        for m in modes:
            v, best = statistics.median(table[m]), max(table[m])
            print(f"  {name:36s} logprobs={str(m):5s} median {v:7.1f} tok/s ({100 * (v / base - 1):+.1f}%), "
                  f"best {best:7.1f} ({100 * (best / max(table[None]) - 1):+.1f}%)")


if __name__ == "__main__":
    main()
