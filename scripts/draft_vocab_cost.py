"""Cost of a drafter's LM head with and without a draft vocabulary (Speculators-format
drafters): the draft logits of one block's B - 1 slots through the target's full LM head,
against a draft LM head of ``--draft-vocab`` rows spread back over the vocabulary (what
:class:`~dflash_torch.models.speculators.SpeculatorsDrafter` does each round). Random
weights at a real model's shape (default: Qwen3-8B's hidden size and vocabulary, the
32000-token draft vocabulary of speculators' default).

    python scripts/draft_vocab_cost.py --dtype bfloat16 --threads 2
"""

import argparse
import time

import torch


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(args.vocab, args.hidden, generator=g).to(dtype)
    draft = full[torch.randperm(args.vocab, generator=g)[:args.draft_vocab]].clone()
    d2t = torch.sort(torch.randperm(args.vocab, generator=g)[:args.draft_vocab]).values - torch.arange(args.draft_vocab)
    slots = torch.randn(args.block_size - 1, args.hidden, generator=g).to(dtype)

    def target_head():
        return torch.nn.functional.linear(slots, full)

    def draft_head():
        logits = torch.nn.functional.linear(slots, draft)
        out = logits.new_full((slots.shape[0], args.vocab), float("-inf"))
        return out.index_copy(-1, d2t + torch.arange(args.draft_vocab), logits)

    with torch.no_grad():
        a, b = best_ms(target_head, args.repeats), best_ms(draft_head, args.repeats)
    print(f"{args.block_size - 1} slots, hidden {args.hidden}, {args.dtype}, {args.threads} threads: "
          f"full LM head ({args.vocab} rows) {a:.2f} ms; draft LM head ({args.draft_vocab} rows) + map {b:.2f} ms "
          f"({a / b:.1f}x less); LM head weights {full.nbytes / 1e6:.0f} MB vs {draft.nbytes / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
