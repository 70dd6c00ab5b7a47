"""Acceptance length (tau) and decode speed of the shipped pair as the prompt grows past the
512-token windows it was trained on.

Each of the first ``--prompts`` held-out prompts of the shipped pair is decoded greedily
(float32) after ``extra`` tokens of other held-out code (the text of the held-out prompts
after them, joined with blank lines and cut to ``extra`` tokens, so the whole prompt stays
code the models did not train on), for each ``extra`` of ``--extra``; prints, per ``extra``,
the mean tau, the mean decode tokens/s of DFlash and of target-only decoding, and whether
DFlash's tokens equal target-only's (they must). The target's context is 4,096 tokens: an
``extra`` whose prompts leave no room for ``--max-new-tokens`` is refused before decoding.

    python scripts/long_prompt_tau.py --threads 1 --prompts 4 --max-new-tokens 128 --extra 0,1000,2000,3500
"""

from __future__ import annotations

import json

import torch

from dflash_torch import DFlashEngine
from dflash_torch.cli import NEEDS_A_ROUND, check_counts, script_errors, script_parser
from dflash_torch.engine import ASSETS
from dflash_torch.errors import DFlashError
from dflash_torch.options import check_threads


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``long_prompt_tau.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--extra", default="0,1000,2000,3500", help="comma-separated counts of extra tokens before each prompt")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "prompts")
        check_counts(args, "max_new_tokens", minimum=2, why=NEEDS_A_ROUND)
        try:
            extras = [int(x) for x in args.extra.split(",")]
        except ValueError:
            raise DFlashError(f"--extra must be comma-separated integers, got {args.extra!r}") from None
        if any(x < 0 for x in extras):
            raise DFlashError(f"--extra counts must be >= 0, got {args.extra!r}")
        torch.set_num_threads(check_threads(args.threads, "--threads"))
        texts = [json.loads(line)["prompt"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()]
        if args.prompts >= len(texts):
            raise DFlashError(f"--prompts must be below {len(texts)} (the held-out prompts after them are the "
                              f"extra code), got {args.prompts}")
        engine = DFlashEngine.from_pretrained(dtype="float32", reuse_prefix=False)
        prompts = [engine.encode_prompt(t) for t in texts[:args.prompts]]
        code = engine.encode_prompt("\n\n".join(texts[args.prompts:]) + "\n\n", check_length=False)
        longest = max(extras) + max(len(p) for p in prompts) + args.max_new_tokens
        if longest > engine.max_context:
            raise DFlashError(f"--extra {max(extras)} makes prompts of up to {longest - args.max_new_tokens} tokens: "
                              f"with --max-new-tokens {args.max_new_tokens} they pass the target's context of "
                              f"{engine.max_context} tokens")
        if max(extras) > len(code):
            raise DFlashError(f"the held-out code holds {len(code)} tokens, fewer than --extra {max(extras)}")
        target_only = DFlashEngine.from_pretrained(no_draft=True, dtype="float32", reuse_prefix=False)
        engine.generate(prompts[0], max_new_tokens=16)  # (warm-up)
        target_only.generate(prompts[0], max_new_tokens=16)
        for extra in extras:
            taus, speeds, ref_speeds, same = [], [], [], True
            for p in prompts:
                ids = code[:extra] + p
                out = engine.generate(ids, max_new_tokens=args.max_new_tokens)
                ref = target_only.generate(ids, max_new_tokens=args.max_new_tokens)
                same &= out.token_ids == ref.token_ids
                taus += out.stats.acceptance_lengths
                speeds.append(out.stats.generated_tokens / out.stats.decode_time)
                ref_speeds.append(ref.stats.generated_tokens / ref.stats.decode_time)
            print(f"extra {extra} tokens: tau {sum(taus) / len(taus):.2f}, DFlash {sum(speeds) / len(speeds):.0f} "
                  f"tok/s, target-only {sum(ref_speeds) / len(ref_speeds):.0f} tok/s, DFlash == target-only: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
