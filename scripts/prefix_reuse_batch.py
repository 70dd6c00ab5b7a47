#!/usr/bin/env python
"""Many conversations over a few slots, with and without prompt-prefix reuse: how much of
each turn's history is taken from a retained prefix instead of being read again.

``--conversations`` conversations of ``--turns`` turns share one
:class:`~dflash_torch.batch.BatchDecoder` of ``--max-batch-size`` slots, as the server runs
them (add, step, remove). Each turn's prompt is the last prompt + its reply
(``--reply-tokens``, greedy) + a new message of ``--message-tokens`` tokens (pieces of
the shipped ``prompts.jsonl``); between turns a conversation waits 0 to ``--max-think``
rounds (seeded), and a turn waits for a free slot in arrival order. It prints the prompt
tokens that retained rows could have given (each turn's last prompt and reply: the rows
its last turn left valid, all but the last committed token's; a message that goes on as the
reply did past its cut gives more; with a system prompt, first turns may take it too), those
reused, those read, and the wall time; both modes must give the same tokens.

With ``--system-tokens N``, every conversation starts with the same N-token system prompt
(its first turn's prompt is that, then its first message), given as the batch decoder's
``shared_end`` (a hybrid or sliding-window target keeps a snapshot of its state there, so
that another conversation's first turn reads only its message, taking the system prompt's
rows from a retained prefix or from a conversation still decoding); a third mode, reuse on
without ``shared_end``, shows what that saves.

    python scripts/prefix_reuse_batch.py --threads 1                       # 4 conversations, 4 slots
    python scripts/prefix_reuse_batch.py --conversations 6 --max-batch-size 4 --prefix-slots 2
    python scripts/prefix_reuse_batch.py --target T --drafter D --system-tokens 250   # a hybrid pair
"""

from __future__ import annotations

import random
import sys
import time

import torch
from batching_common import add_common_args, load_engine, shipped_tokens, write_json

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cli import check_counts, script_errors, script_parser


def run(engine, args, messages: list[list[list[int]]], reuse: bool, system: list[int], shared: bool = True) -> dict:
    """Every conversation's turns through one batch (each first prompt after ``system``, whose
    end is given as ``shared_end`` with ``shared``) -> tokens and counts."""
    convs, reply = args.conversations, args.reply_tokens
    context = len(system) + sum(len(m) for m in messages[0]) + args.turns * reply + engine.decoder.block_size + 1
    shared_end = len(system) if system and shared else None
    batch = BatchDecoder(engine.target, engine.drafter, max_batch_size=args.max_batch_size, max_context=context,
                         prefill_chunk=engine.decoder.prefill_chunk, reuse_prefix=reuse,
                         prefix_slots=args.prefix_slots if reuse else 0)
    rng = random.Random(args.seed)
    prompts = {c: system + list(messages[c][0]) for c in range(convs)}
    turn, wait = dict.fromkeys(range(convs), 0), {c: rng.randrange(args.max_think + 1) for c in range(convs)}
    out, replies, queue, live = {}, {c: [] for c in range(convs)}, [], set()
    reusable = 0
    t0 = time.perf_counter()
    while queue or live or any(turn[c] < args.turns for c in range(convs)):
        for c in range(convs):
            if c not in live and c not in queue and turn[c] < args.turns:
                wait[c] -= 1
                if wait[c] < 0:
                    queue.append(c)
        while queue and batch.free_slots:
            c = queue.pop(0)
            out[c] = list(batch.add(c, prompts[c], SamplingParams(), reply, shared_end=shared_end).tokens)
            live.add(c)
        for c, rnd in batch.step().items():
            out[c] += rnd.tokens
        for c in [c for c in live if len(out[c]) >= reply]:
            batch.remove(c)
            live.discard(c)
            replies[c].append(out[c][:reply])
            turn[c] += 1
            if turn[c] < args.turns:
                # (the rows of every committed token but the last are written: a reply cut from a longer round
                # has all its rows, one that ends the round lacks its last token's)
                reusable += len(prompts[c]) + min(len(out[c]) - 1, reply)
                prompts[c] += out[c][:reply] + messages[c][turn[c]]
            wait[c] = rng.randrange(args.max_think + 1)
    return {"seconds": time.perf_counter() - t0, "reusable": reusable, "reused": batch.reused_prefill_tokens,
            "read": batch.prefill_tokens, "tokens": replies}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``prefix_reuse_batch.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--max-batch-size", type=int, default=4)
    ap.add_argument("--prefix-slots", type=int, default=0, help="slots that only keep retained prefixes")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--message-tokens", type=int, default=64, help="tokens of each new message")
    ap.add_argument("--reply-tokens", type=int, default=24, help="tokens of each reply (greedy)")
    ap.add_argument("--max-think", type=int, default=5, help="most rounds a conversation waits between turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-tokens", type=int, default=0, help="tokens of a system prompt every conversation starts with")
    add_common_args(ap, pair=True)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "conversations", "max_batch_size", "turns", "message_tokens", "reply_tokens", "max_think")
        check_counts(args, "system_tokens", minimum=0)
        engine = load_engine(args)
        m, n, k0 = args.message_tokens, args.conversations * args.turns, args.system_tokens
        corpus = shipped_tokens(engine, k0 + n * m)
        system, corpus = corpus[:k0], corpus[k0:]
        messages = [[corpus[(c * args.turns + k) * m:(c * args.turns + k + 1) * m] for k in range(args.turns)]
                    for c in range(args.conversations)]
        results = {}
        modes = {"reuse on": (True, True), "reuse off": (False, True)}
        if system:
            modes["reuse on, no shared_end"] = (True, False)
        with torch.inference_mode():
            for name, (reuse, shared) in modes.items():
                r = results[name] = run(engine, args, messages, reuse, system, shared)
                # (with a system prompt, first turns may take it too, beyond the histories: no percentage then)
                share = (f"prompt tokens (the histories hold {r['reusable']}; first turns may take the {k0}-token system "
                         "prompt too)" if system else
                         f"of {r['reusable']} reusable prompt tokens ({r['reused'] / max(r['reusable'], 1):.0%})")
                print(f"{name}: reused {r['reused']} {share}, read {r['read']}, {r['seconds']:.2f} s", flush=True)
        same = all(r["tokens"] == results["reuse off"]["tokens"] for r in results.values())
        print(f"{args.conversations} conversations x {args.turns} turns over {args.max_batch_size} slots "
              f"(+ {args.prefix_slots} prefix slots), a system prompt of {k0} tokens, messages of {m} "
              f"tokens, replies of {args.reply_tokens}; {args.dtype}, {torch.get_num_threads()} thread(s); "
              f"outputs identical: {same}")
        write_json(args, {k: {x: v for x, v in r.items() if x != "tokens"} for k, r in results.items()}
                   | {"identical": same})
        if not same:
            sys.exit("the two modes gave different tokens")


if __name__ == "__main__":
    main()
