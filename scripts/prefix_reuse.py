#!/usr/bin/env python
"""A multi-turn conversation with and without prompt-prefix reuse
(``BatchDecoder(reuse_prefix=True)``, the default, against ``reuse_prefix=False``).

Three turns go through an empty :class:`~dflash_torch.batch.BatchDecoder` of
``--max-batch-size`` slots (the server's default 8) as the server runs them (join, step,
remove), or with ``--one-at-a-time`` through a
:class:`~dflash_torch.decoding.SpeculativeDecoder` (as ``DFlashEngine.generate`` and
``serve --max-batch-size 1`` decode, keeping the last request's rows): turn k's prompt is turn k-1's prompt + its reply (``--reply-tokens``, greedy) +
a new message of ``--message-tokens`` tokens (pieces of the shipped ``prompts.jsonl``),
so turn 3 reads a ~1,500-token prompt by default. ``--history-reply-tokens K`` keeps only
the first K tokens of each reply in the next prompt (a reply cut by a stop string, or a
chat template that renders the last reply differently from the tokens generated).
``--reply-opening TEXT`` ends each prompt with the tokens of TEXT, which the next prompt's
history does not repeat (a template's opening of the reply, e.g. a thinking tag, that it
renders otherwise in past turns), and gives where the history ends as the decoders'
``checkpoint`` (as the engine and the server do for chat messages; ``--no-checkpoint``: not;
only hybrid and sliding-window models use it). For each mode it prints each turn's time
to first token (join to the prefill round), the prompt tokens the target read and those
reused. Both modes must give the same tokens. ``--reps`` repetitions (a fresh decoder each)
alternate which mode runs first; medians are reported.

    python scripts/prefix_reuse.py --threads 1                 # shipped pair, float32
    python scripts/prefix_reuse.py --threads 1 --one-at-a-time # one sequence at a time
    python scripts/prefix_reuse.py --target T --drafter D      # another pair (e.g. a hybrid target)
    python scripts/prefix_reuse.py --target T --drafter D --reply-opening "<think>"
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from batching_common import add_common_args, load_engine, shipped_tokens, write_json

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cli import check_counts, script_errors, script_parser
from dflash_torch.decoding import SpeculativeDecoder


def turn(batch: BatchDecoder, sid, prompt: list[int], new_tokens: int,
         checkpoint: int | None = None) -> tuple[list[int], float]:
    """One request: join, step until it has ``new_tokens`` tokens, remove -> its tokens and
    its time to first token (seconds)."""
    t0 = time.perf_counter()
    batch.join(sid, prompt, SamplingParams(), new_tokens, checkpoint=checkpoint)
    out, ttft = [], None
    while len(out) < new_tokens:
        for rnd in batch.step().values():
            if ttft is None:
                ttft = time.perf_counter() - t0
            out += rnd.tokens
    batch.remove(sid)
    return out[:new_tokens], ttft


def serial_turn(decoder: SpeculativeDecoder, prompt: list[int], new_tokens: int,
                checkpoint: int | None = None) -> tuple[list[int], float]:
    """One request decoded alone -> its tokens and its time to first token (seconds)."""
    t0 = time.perf_counter()
    out, ttft = [], None
    for rnd in decoder.rounds(prompt, SamplingParams(), new_tokens, checkpoint=checkpoint):
        if ttft is None:
            ttft = time.perf_counter() - t0
        out += rnd.tokens
    return out[:new_tokens], ttft


def conversation(engine, messages: list[list[int]], reply_tokens: int, reuse: bool, max_batch_size: int,
                 history_tokens: int | None = None, one_at_a_time: bool = False, opening: list[int] = (),
                 checkpoints: bool = True) -> dict:
    context = sum(map(len, messages)) + len(messages) * (reply_tokens + len(opening))
    if one_at_a_time:
        decoder = SpeculativeDecoder(engine.target, engine.drafter, max_context=context + engine.block_size,
                                     prefill_chunk=engine.decoder.prefill_chunk, reuse_prefix=reuse)
    else:
        batch = BatchDecoder(engine.target, engine.drafter, max_batch_size=max_batch_size, max_context=context,
                             prefill_chunk=engine.decoder.prefill_chunk, reuse_prefix=reuse)
    history, replies, ttfts, read, reused = [], [], [], [], []
    for k, message in enumerate(messages):
        history = history + (replies[-1][:history_tokens] if replies else []) + message
        prompt = history + list(opening)
        checkpoint = len(history) if opening and checkpoints else None
        if one_at_a_time:
            u0 = decoder.reused_prefill_tokens
            reply, ttft = serial_turn(decoder, prompt, reply_tokens, checkpoint)
            reused.append(decoder.reused_prefill_tokens - u0)
            read.append(len(prompt) - reused[-1])
        else:
            r0, u0 = batch.prefill_tokens, batch.reused_prefill_tokens
            reply, ttft = turn(batch, k, prompt, reply_tokens, checkpoint)
            read.append(batch.prefill_tokens - r0)
            reused.append(batch.reused_prefill_tokens - u0)
        replies.append(reply)
        ttfts.append(ttft)
    return {"ttft_s": ttfts, "prompt_tokens": len(prompt), "read": read, "reused": reused, "tokens": replies}


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``prefix_reuse.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--message-tokens", type=int, default=450, help="tokens of each new message")
    ap.add_argument("--reply-tokens", type=int, default=64, help="tokens of each reply (greedy)")
    ap.add_argument("--history-reply-tokens", type=int, default=None,
                    help="tokens of each reply kept in the next prompt (default: all)")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="decode the turns with SpeculativeDecoder (one sequence at a time) instead of BatchDecoder")
    ap.add_argument("--reply-opening", default=None, metavar="TEXT",
                    help="text whose tokens end each prompt but not the next prompt's history")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="with --reply-opening: give the decoders no checkpoint where the history ends")
    add_common_args(ap, pair=True)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "turns", "message_tokens", "reply_tokens", "max_batch_size")
        engine = load_engine(args)
        opening = engine.tokenizer.encode(args.reply_opening, add_special_tokens=False) if args.reply_opening else []
        corpus = shipped_tokens(engine)
        m = args.message_tokens
        messages = [corpus[k * m:(k + 1) * m] for k in range(args.turns)]
        assert all(len(x) == m for x in messages), "the shipped prompts are too short for these messages"
        labels = {True: "reuse on", False: "reuse off"}
        with torch.inference_mode():
            conversation(engine, [x[:100] for x in messages[:2]], 8, True, args.max_batch_size,
                         one_at_a_time=args.one_at_a_time)  # warm-up
            results = {True: [], False: []}
            for rep in range(args.reps):
                for reuse in ((True, False) if rep % 2 == 0 else (False, True)):
                    r = conversation(engine, messages, args.reply_tokens, reuse, args.max_batch_size,
                                     args.history_reply_tokens, args.one_at_a_time, opening, not args.no_checkpoint)
                    results[reuse].append(r)
                    print(f"rep {rep} {labels[reuse]:9}: time to first token per turn "
                          f"{' / '.join(f'{t:.2f}' for t in r['ttft_s'])} s, prompt tokens read {r['read']}, "
                          f"reused {r['reused']}", flush=True)
        same = all(r["tokens"] == results[True][0]["tokens"] for rs in results.values() for r in rs)
        last = results[True][0]["prompt_tokens"]
        kept = "" if args.history_reply_tokens is None else f", {args.history_reply_tokens} of each kept"
        if opening:
            kept += f"; a {len(opening)}-token reply opening, {'no ' if args.no_checkpoint else ''}checkpoint"
        print(f"\n{args.turns} turns, messages of {m} tokens, replies of {args.reply_tokens} (greedy{kept}); the last prompt "
              f"{last} tokens; {args.dtype}, {torch.get_num_threads()} thread(s); medians of {args.reps}:")
        summary = {}
        for reuse in (False, True):
            med = [statistics.median(r["ttft_s"][k] for r in results[reuse]) for k in range(args.turns)]
            summary[labels[reuse]] = {"ttft_s": med, "read": results[reuse][0]["read"], "reused": results[reuse][0]["reused"]}
            print(f"  {labels[reuse]:9}: time to first token per turn {' / '.join(f'{t:.2f}' for t in med)} s, "
                  f"prompt tokens read {results[reuse][0]['read']}, reused {results[reuse][0]['reused']}")
        print(f"  outputs identical across modes and reps: {same}")
        write_json(args, {"summary": summary, "identical": same})
        if not same:
            sys.exit("the two modes gave different tokens")


if __name__ == "__main__":
    main()
