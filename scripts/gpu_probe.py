"""The eager-CUDA probe of scripts/gpu_check.sh: the machine, the device's copy bandwidth,
and what cuDNN attention costs eager decoding.

Eager rounds attend over a key length that grows every round. The decoder runs its eager
CUDA steps with SDPA restricted to backends that build no per-shape plan (cuDNN attention
left out). Here the same eager loop runs both ways on the shipped pair (bf16, greedy,
distinct held-out prompts), each prompt decoded twice in a row: with cuDNN the first
decode pays for one plan per new shape and the repeat reuses them; without it the two
should run alike. A profile of one first decode with cuDNN names the ops that cost most.

Usage: python scripts/gpu_probe.py [--prompts N] [--tokens N] [--json OUT.json]   (needs CUDA)
  --prompts N: prompts per group, 1 to 31 (two groups and one profiled prompt out of the
  64 held-out prompts); --tokens N: tokens per decode, at least 2
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.engine import ASSETS, DFlashEngine
from dflash_torch.sampling import SamplingParams


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (median of 5)."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * n * 2 / sorted(times[1:])[2]


def decode(decoder: SpeculativeDecoder, ids: list[int], tokens: int) -> float:
    """Decode tokens per second of one greedy decode (prefill excluded)."""
    n, t = 0, 0.0
    for rnd in decoder.rounds(ids, SamplingParams(), tokens):
        if rnd.acceptance_length is not None:
            n += len(rnd.tokens)
            t += rnd.total_time
    return n / t


def main() -> None:
    prompts = [json.loads(line)["prompt"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()]
    most = (len(prompts) - 1) // 2  # (two groups of --prompts, then one more for the profile)
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts per group, 1 to {most} (default 4)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per decode, at least 2: the first comes from the "
                                                              "prefill (default 256)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not 1 <= args.prompts <= most:
        ap.error(f"--prompts must be 1 to {most} (two groups and one more out of {len(prompts)} held-out prompts), "
                 f"got {args.prompts}")
    if args.tokens < 2:
        ap.error(f"--tokens must be at least 2 (the first comes from the prefill), got {args.tokens}")
    if not torch.cuda.is_available():  # (one line, as scripts/gpu_check.sh's; not an assertion's traceback)
        print(f"gpu_probe.py: error: no CUDA device (torch {torch.__version__} sees none); run it on a machine with an "
              "NVIDIA GPU and torch built with CUDA", file=sys.stderr)
        sys.exit(2)
    props = torch.cuda.get_device_properties(0)
    out = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "python": platform.python_version()}
    print(f"device {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    out["copy_bandwidth_tb_s"] = copy_bandwidth() / 1e12
    print(f"device-to-device copy: {out['copy_bandwidth_tb_s']:.2f} TB/s (read + write)", flush=True)

    engine = DFlashEngine.from_pretrained(dtype="bfloat16", device="cuda")
    ids = [engine.encode_prompt(p) for p in prompts[: 2 * args.prompts]]
    decoder = SpeculativeDecoder(engine.target, engine.drafter)
    decode(decoder, ids[-1], 32)  # CUDA context, kernels loaded
    results = {}
    for label, group in (("without cuDNN attention (the decoder's eager CUDA steps)", ids[: args.prompts]),
                         ("with cuDNN attention (SDPA's default choice)", ids[args.prompts:])):
        if label.startswith("with "):  # the plain steps, SDPA choosing its backend
            decoder._prefill_fn, decoder._draft_fn, decoder._verify_fn = \
                decoder._prefill_step, decoder._draft_step, decoder._verify_step
        first = [decode(decoder, p, args.tokens) for p in group]
        again = [decode(decoder, p, args.tokens) for p in group]
        results[label] = {"first": first, "repeat": again}
        print(f"eager inject {label}: first decode of each prompt "
              f"{sum(first) / len(first):.0f} tok/s, repeat {sum(again) / len(again):.0f} tok/s "
              f"(per prompt: {', '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(first, again))})", flush=True)
    out["eager_inject_tok_s"] = results
    # the profile of one more first decode with cuDNN allowed (a prompt not decoded before)
    extra = engine.encode_prompt(prompts[2 * args.prompts])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        decode(decoder, extra, 64)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
    print("profile of a first eager decode with cuDNN attention allowed (64 tokens), by CPU time:\n" + table, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
