"""Speed of gpt-oss's sink attention on the CPU: torch's flash-attention kernel with each
row scaled by its log-sum-exp (``gpt_oss._sink_attend_flash``, a CPU's for prefill chunks) vs the
logits written out (``gpt_oss._sink_attend_logits``), in one process, alternating.

Part 1 times the attention alone at gpt-oss-20b's heads (64 query, 8 key/value heads of 64
dimensions) for blocks of queries over ``--keys`` cached keys (causal rows, as a verify or a
prefill chunk sees them); part 2 (``--prefill N``) times a tiny gpt-oss target's prefill of
an N-token prompt both ways (the test suite's checkpoint builder).

    python scripts/sink_attention_speed.py --keys 4096 --queries 16 256 1024 --prefill 8000
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dflash_torch.cli import check_counts, script_errors, script_parser  # noqa: E402
from dflash_torch.models import gpt_oss  # noqa: E402
from dflash_torch.options import check_count, check_threads  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention(keys: int, queries: list[int], dtype: torch.dtype, repeats: int) -> None:
    heads, kv_heads, dim = 64, 8, 64
    for tq in queries:
        q = torch.randn(heads, tq, dim, dtype=dtype)
        k, v = torch.randn(kv_heads, keys, dim, dtype=dtype), torch.randn(kv_heads, keys, dim, dtype=dtype)
        causal = torch.zeros(tq, keys).masked_fill(torch.arange(keys) > torch.arange(keys - tq, keys)[:, None],
                                                   float("-inf"))
        bias, sinks = causal.repeat(heads // kv_heads, 1), torch.randn(heads)
        logits = median_seconds(lambda: gpt_oss._sink_attend_logits(q, k, v, bias, sinks), repeats)
        flash = median_seconds(lambda: gpt_oss._sink_attend_flash(q, k, v, bias, sinks), repeats)
        print(f"{tq:>6} queries x {keys} keys: logits {logits * 1e3:8.1f} ms  flash {flash * 1e3:8.1f} ms  "
              f"{logits / flash:.1f}x", flush=True)


def prefill(tokens: int, chunk: int, repeats: int) -> None:
    from conftest import make_gpt_oss_target

    from dflash_torch import DFlashEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = DFlashEngine.from_pretrained(str(make_gpt_oss_target(Path(tmp) / "target")), no_draft=True,
                                              prefill_chunk=chunk, max_context=tokens + 8, reuse_prefix=False)
        ids = torch.randint(10, 200, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        real = gpt_oss._FLASH_CPU
        timed = {}
        try:
            for path in ("logits", "flash") * repeats:
                gpt_oss._FLASH_CPU = real if path == "flash" else None
                start = time.perf_counter()
                engine.generate(ids, max_new_tokens=1)
                timed.setdefault(path, []).append(time.perf_counter() - start)
        finally:
            gpt_oss._FLASH_CPU = real
        logits, flash = statistics.median(timed["logits"]), statistics.median(timed["flash"])
        print(f"tiny gpt-oss prefill of {tokens} tokens (chunks of {chunk}): logits {logits:.2f} s  flash {flash:.2f} s  "
              f"{logits / flash:.1f}x", flush=True)


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``sink_attention_speed.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--keys", type=int, default=4096, help="cached keys each query block attends to")
    ap.add_argument("--queries", type=int, nargs="+", default=[16, 256, 1024], help="query rows per block")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="also time a tiny gpt-oss's N-token prefill")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "keys", "prefill_chunk", "repeats")
        for n in args.queries:
            check_count(n, "--queries")
        if args.prefill:  # (0: none)
            check_count(args.prefill, "--prefill")
        if gpt_oss._FLASH_CPU is None:
            sys.exit("this torch has no CPU flash-attention kernel (aten._scaled_dot_product_flash_attention_for_cpu)")
        torch.set_num_threads(check_threads(args.threads, "--threads"))
        print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}")
        attention(args.keys, args.queries, getattr(torch, args.dtype), args.repeats)
        if args.prefill:
            prefill(args.prefill, args.prefill_chunk, args.repeats)


if __name__ == "__main__":
    main()
