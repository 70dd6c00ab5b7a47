"""What the penalties (presence / frequency / repetition) cost per decoded token.

Decodes the first prompts of the shipped pair's held-out set with the shipped pair, greedy,
three ways interleaved in one process: no penalty, a penalty too small to change any
token (``presence_penalty=1e-9``: the same tokens, so the same rounds, and every penalty
operation still runs) and a real one (``presence_penalty=0.5``: other tokens, other
acceptance lengths). Prints decode tokens/s (medians over the runs) and mean tau.

    python scripts/penalty_overhead.py --threads 1 --prompts 4 --max-new-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dflash_torch import DFlashEngine
from dflash_torch.engine import ASSETS

SETTINGS = {"none": {}, "tiny (same tokens)": dict(presence_penalty=1e-9), "presence 0.5": dict(presence_penalty=0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-draft", action="store_true", help="target-only decoding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = DFlashEngine.from_pretrained(no_draft=args.no_draft)
    lines = (ASSETS / "prompts.jsonl").read_text().splitlines()[: args.prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    engine.generate(prompts[0], max_new_tokens=8)  # warm-up
    rates = {name: [] for name in SETTINGS}
    taus = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for prompt in prompts:
            outs = {}
            for name, kw in SETTINGS.items():
                out = engine.generate(prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True, **kw)
                outs[name] = out.token_ids
                rates[name].append(out.stats.decode_tokens_per_second)
                taus[name].append(out.stats.mean_acceptance_length)
            assert outs["tiny (same tokens)"] == outs["none"], "the tiny penalty changed the tokens"
    base = statistics.median(rates["none"])
    for name in SETTINGS:
        r = statistics.median(rates[name])
        print(f"{name:20s} decode {r:8.1f} tok/s ({r / base - 1:+.1%})  mean tau {statistics.mean(taus[name]):.2f}")


if __name__ == "__main__":
    main()
