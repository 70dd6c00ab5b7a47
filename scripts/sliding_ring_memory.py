"""What the rings of sliding-window layers save (dflash_torch.cache): KV-cache bytes of one
sequence of the published sliding-window targets at several context lengths, every
position kept vs rings (exact: counted from the models' layer shapes, nothing allocated),
and the time of one verify forward (16 rows) at a long context, on layers with a
target's attention shapes.

    python scripts/sliding_ring_memory.py [--contexts 4096 32768 131072] [--time-context 16384]

The timed model has the attention shapes of ``--time-shape`` (default gemma-4-31b: 32
query heads of 256 over 16 key/value heads on the sliding layers, 4 of 512 on the full
ones) and one period of its layer pattern (5 sliding + 1 full), with a small MLP and
vocabulary so that it fits a small machine; its cache is filled with random keys and
values (attention time does not depend on them).
"""

from __future__ import annotations

import statistics
import time

import torch

from dflash_torch.bench.shapes import SHAPES, build_pair, pattern_period, target_config
from dflash_torch.cache import cache_bytes
from dflash_torch.cli import check_counts, script_errors, script_parser
from dflash_torch.models.registry import family
from dflash_torch.options import check_count, check_threads

SHAPES_WITH_WINDOWS = ["gpt-oss-20b", "gpt-oss-120b", "gemma-4-31b", "gemma-4-26b-a4b"]


def memory_table(contexts: list[int], max_rows: int, dtype: torch.dtype) -> None:
    print(f"KV cache of one sequence, {str(dtype).removeprefix('torch.')}, rings for max_rows {max_rows} "
          "(block 16, prefill chunk 256)")
    print(f"{'target':<18}{'windows':>9}" + "".join(f"{f'{n} tok: all / rings':>28}" for n in contexts))
    for shape in SHAPES_WITH_WINDOWS:
        cfg = target_config(shape)
        with torch.device("meta"):
            target = family(cfg.model_type).Model(cfg)
        target.model.embed_tokens.weight.data = torch.empty(0, dtype=dtype, device="meta")  # (element size only)
        windows = sorted({w for w in target.kv_windows() if w})
        cells = []
        for n in contexts:
            every, rings = cache_bytes(target, None, 1, n), cache_bytes(target, None, 1, n, max_rows)
            cells.append(f"{every / 2**30:7.2f} / {rings / 2**30:5.2f} GiB ({every / rings:4.1f}x)")
        print(f"{shape:<18}{','.join(map(str, windows)):>9}" + "".join(f"{c:>28}" for c in cells))


def time_verify(shape: str, context: int, reps: int, dtype: torch.dtype) -> None:
    base = target_config(shape)
    period = pattern_period(base)
    cfg = {**SHAPES[shape], "num_hidden_layers": period, "intermediate_size": 1024, "vocab_size": 4096}
    for key in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size"):
        cfg.pop(key, None)
    target, _ = build_pair(cfg, dtype, "cpu", draft_layers=1)
    rows = 16
    ids = torch.zeros(rows, dtype=torch.long)
    positions = context + torch.arange(rows)
    caches = {}
    for name, max_rows in (("every position", None), ("rings", 256)):
        cache = target.new_cache(max_rows)
        cache.reset(context + rows)
        for t in cache.kv.k + cache.kv.v:
            t.normal_()
        caches[name] = cache
    runs = {name: [] for name in caches}
    with torch.inference_mode():
        for rep in range(reps + 1):  # interleaved (a shared machine's load hits both alike); the first is a warm-up
            for name, cache in caches.items():
                t0 = time.perf_counter()
                target(ids, positions, cache, context + rows)
                if rep:
                    runs[name].append(time.perf_counter() - t0)
    for name, cache in caches.items():
        kv = sum(t.numel() * t.element_size() for t in cache.kv.k + cache.kv.v)
        print(f"  {name:<15} verify of {rows} rows at {context} tokens: {statistics.median(runs[name]) * 1e3:8.1f} ms "
              f"(median of {reps}), KV {kv / 2**20:8.1f} MiB")
    ratios = [a / b for a, b in zip(runs["every position"], runs["rings"])]
    print(f"  time with every position / with rings: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``; None: ``sys.argv``). A bad option value ends it with one line
    ``sliding_ring_memory.py: error: ...`` on stderr, exit status 2 (``SystemExit``)."""
    ap = script_parser(__file__, __doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--time-shape", default="gemma-4-31b", choices=SHAPES_WITH_WINDOWS)
    ap.add_argument("--time-context", type=int, default=16384, help="0: skip the timing")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    with script_errors(ap, args):
        check_counts(args, "reps")
        for n in args.contexts:
            check_count(n, "--contexts")
        if args.time_context:  # (0: no timing)
            check_count(args.time_context, "--time-context")
        if args.threads is not None:
            torch.set_num_threads(check_threads(args.threads, "--threads"))
        memory_table(args.contexts, 256, torch.bfloat16)
        if args.time_context:
            print(f"\none verify forward, attention shapes of {args.time_shape}, one period of its layers, bfloat16, CPU "
                  f"({torch.get_num_threads()} threads):")
            time_verify(args.time_shape, args.time_context, args.reps, torch.bfloat16)


if __name__ == "__main__":
    main()
