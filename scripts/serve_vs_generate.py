#!/usr/bin/env python
"""Decode speed of ``dflash-torch serve`` against ``generate`` on the same prompt, in one run.

Starts ``dflash-torch serve`` as a subprocess and loads the same engine in this process
the way ``dflash-torch generate`` does (all torch work on this thread), then alternates greedy ``--max-new-tokens``
requests (EOS ignored) between the two, ``--reps`` times each, switching which goes
first every repetition so that a slow spell of a shared machine hits both alike. It
prints, per repetition and as medians, the decode tokens/s that each reports
(``stats.decode_tokens_per_second``, the server's ``dflash`` object) and the end-to-end
tokens/s (tokens over the wall time of the call, HTTP included), and the ratios
serve / generate. Both outputs must be the same tokens.

    python scripts/serve_vs_generate.py                # shipped default pair, float32, eager
    python scripts/serve_vs_generate.py --compile      # both sides with --compile (warmed up first)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from dflash_torch import DFlashEngine  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    try:  # what the generate command does (older versions ran everything on the calling thread anyway)
        from dflash_torch.compute import this_thread
    except ImportError:
        this_thread = contextlib.nullcontext
    with this_thread():
        return _main()


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's choice)")
    args = ap.parse_args()

    port = _free_port()
    model_args = ["--dtype", args.dtype] + (["--compile"] if args.compile else []) + \
        (["--threads", str(args.threads)] if args.threads else [])
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = subprocess.Popen([sys.executable, "-m", "dflash_torch.cli", "serve", "--port", str(port), "--model-name", "m",
                               "--log-level", "warning", *model_args], env=env, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = DFlashEngine.from_pretrained(dtype=args.dtype, compile=args.compile)
        if args.compile:
            engine.warmup()
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        n = args.max_new_tokens
        body = {"model": "m", "prompt": args.prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}

        def run_generate():
            t0 = time.perf_counter()
            out = engine.generate(args.prompt, max_new_tokens=n, ignore_eos=True)
            wall = time.perf_counter() - t0
            return out.text, out.stats.decode_tokens_per_second, len(out.token_ids) / wall

        def run_serve():
            t0 = time.perf_counter()
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
            wall = time.perf_counter() - t0
            r.raise_for_status()
            d = r.json()
            assert d["usage"]["completion_tokens"] == n, d["usage"]
            return d["choices"][0]["text"], d["dflash"]["decode_tokens_per_second"], n / wall

        run_generate(), run_serve()  # warm both (first-request allocations)
        rows = []
        print(f"{'rep':>3} {'first':>8} | {'generate decode':>15} {'serve decode':>12} {'ratio':>6} | "
              f"{'generate e2e':>12} {'serve e2e':>9} {'ratio':>6}   (tok/s)")
        for rep in range(args.reps):
            first = "generate" if rep % 2 == 0 else "serve"
            if first == "generate":
                g, s = run_generate(), run_serve()
            else:
                s, g = run_serve(), run_generate()
            if g[0] != s[0]:
                raise SystemExit("serve and generate produced different text")
            rows.append((g[1], s[1], g[2], s[2]))
            print(f"{rep:>3} {first:>8} | {g[1]:>15.1f} {s[1]:>12.1f} {s[1] / g[1]:>6.3f} | "
                  f"{g[2]:>12.1f} {s[2]:>9.1f} {s[2] / g[2]:>6.3f}", flush=True)
        med = [statistics.median(col) for col in zip(*rows)]
        ratio_decode = statistics.median(r[1] / r[0] for r in rows)
        ratio_e2e = statistics.median(r[3] / r[2] for r in rows)
        print(f"median: decode generate {med[0]:.1f} / serve {med[1]:.1f} tok/s, serve/generate {ratio_decode:.3f} "
              f"(median of per-rep ratios); end-to-end generate {med[2]:.1f} / serve {med[3]:.1f} tok/s, "
              f"serve/generate {ratio_e2e:.3f}  [{args.dtype}, {'compiled' if args.compile else 'eager'}, "
              f"{n} tokens, {args.reps} reps]")
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
