"""``bench --batch-sizes``: aggregate throughput and per-request latency of batched
decoding (:class:`~dflash_torch.batch.BatchDecoder`), DFlash against batched target-only,
at each batch size.

At batch size N the prompts are served as N concurrent streams: N requests run at once
and, whenever one finishes, the next prompt joins at the round boundary (continuous
batching). Greedy decoding, EOS ignored, every request generates exactly
``max_new_tokens`` tokens. Every batch size serves the same requests: the prompts, cycled
to at least :data:`REQUESTS_PER_SLOT` times the largest batch size, so that the batch stays
full for most of the run (with as many requests as slots, the streams that finish first
leave the last rounds to a shrinking batch and the aggregate understates batching); each
row reports its mean batch occupancy (``mean_batch``).
"""

from __future__ import annotations

import gc
import re
import time

import torch

from ..batch import BatchDecoder, cache_sizes
from ..cache import cache_bytes, most_that_fits
from ..checkpoint import available_memory, memory_text
from ..errors import DFlashError, OptionError
from ..models.drafter import DFlashDrafter
from ..models.target import TargetModel
from ..options import context_limit
from ..sampling import SamplingParams
from . import fmt, pyplot, ratio


REQUESTS_PER_SLOT = 4


def requests_for(prompt_ids: list[list[int]], batch_sizes: list[int]) -> list[list[int]]:
    """The requests of a batch-size bench: ``prompt_ids`` cycled to at least
    ``REQUESTS_PER_SLOT * max(batch_sizes)`` requests (all of them when there are more)."""
    n = max(len(prompt_ids), REQUESTS_PER_SLOT * max(batch_sizes))
    return [prompt_ids[i % len(prompt_ids)] for i in range(n)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def serve_all(batch: BatchDecoder, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Decode every prompt through ``batch`` as ``batch.max_batch_size`` concurrent streams.

    Returns:
        ``wall_s`` (first prefill to last token), ``decode_s`` (time in decoding rounds),
        ``generated_tokens`` (all requests), ``decode_tokens`` (those the rounds committed,
        i.e. without each request's first token, which its prefill makes),
        ``latencies_s`` (per request, its prefill start to its last token), ``rounds``,
        ``target_only_rounds`` (of those, the rounds run without drafts:
        :attr:`~dflash_torch.batch.BatchDecoder.target_only_rounds`, the draft policy's; 0 for a
        decoder without a drafter), ``mean_batch`` (sequences decoded per round),
        ``mean_acceptance_length`` and ``outputs`` (token ids per prompt).
    """
    params = SamplingParams()
    waiting = list(range(len(prompt_ids)))
    tokens: dict[int, list[int]] = {}
    started: dict[int, float] = {}
    latencies, taus, decode_s, rounds, batch_rows = [], [], 0.0, 0, 0
    plain = batch.target_only_rounds  # (the warm-up's before)
    t_start = time.perf_counter()
    while waiting or batch.seq_ids:
        while waiting and batch.free_slots:
            i = waiting.pop(0)
            started[i] = time.perf_counter()
            tokens[i] = list(batch.add(i, prompt_ids[i], params, max_new_tokens).tokens)
        t0 = time.perf_counter()
        step = batch.step()
        decode_s += time.perf_counter() - t0
        rounds += 1
        batch_rows += len(step)
        for i, rnd in step.items():
            kept = min(len(rnd.tokens), max_new_tokens - len(tokens[i]))  # (the last round's: those kept)
            tokens[i] += rnd.tokens
            if kept > 0:
                taus.append(kept)
        now = time.perf_counter()
        for i in list(batch.seq_ids):
            if len(tokens[i]) >= max_new_tokens:
                tokens[i] = tokens[i][:max_new_tokens]
                latencies.append(now - started[i])
                batch.remove(i)
    wall = time.perf_counter() - t_start
    generated = sum(len(t) for t in tokens.values())
    return {"wall_s": wall, "decode_s": decode_s, "generated_tokens": generated,
            "decode_tokens": generated - len(prompt_ids), "latencies_s": latencies, "rounds": rounds,
            "target_only_rounds": batch.target_only_rounds - plain,
            "mean_batch": batch_rows / rounds if rounds else None,
            "mean_acceptance_length": sum(taus) / len(taus) if taus else None,
            "outputs": [tokens[i] for i in range(len(prompt_ids))]}


def _batch_max_context(target: TargetModel, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
    """The caches' context: the longest prompt + ``max_new_tokens`` + 1, at most the target's."""
    return min(context_limit(target.config), max(map(len, prompt_ids)) + max_new_tokens + 1)


def _batch_decoder(target: TargetModel, drafter: DFlashDrafter | None, n: int, max_context: int,
                   block_size: int | None, draft_max_batch_size: int | str | None) -> BatchDecoder:
    """The batch decoder of one row (``reuse_prefix`` off: the requests cycle the prompts, a
    retained prefix would spare their prefills). Its refusals name bench's flags."""
    try:
        return BatchDecoder(target, drafter, block_size=block_size if drafter is not None else None,
                            max_batch_size=n, max_context=max_context, reuse_prefix=False,
                            draft_max_batch_size=draft_max_batch_size if drafter is not None else None)
    except OptionError as e:  # (the decoder's option names -> bench's flags, or what bench sizes itself)
        message = str(e).replace(f"max_batch_size {n} x max_context {max_context}",
                                 f"{n} sequences x {max_context} positions (the longest prompt + --max-new-tokens)")
        message = message.replace("; lower either", "; lower --batch-sizes or --max-new-tokens")
        message = re.sub(r" \(at most (\d+) tokens of context fit these slots in 90% of that\)",
                         rf" ({n} sequences of at most \1 positions fit in 90% of that)", message)
        for name, flag in (("draft_max_batch_size", "--draft-max-batch-size"), ("max_batch_size", "--batch-sizes"),
                           ("max_context", "the context"), ("block size", "--block-size")):
            message = message.replace(name, flag)
        raise DFlashError(f"--batch-sizes {n}: {message}") from None


def batch_caches_bytes(target: TargetModel, drafter: DFlashDrafter | None, n: int, max_context: int,
                       block_size: int | None = None) -> int:
    """Bytes of the caches of the batch decoder of one row at batch size ``n`` (see
    :func:`batch_size_bench`: prefix reuse off, the default prefill chunk of 256, at most
    ``max_context``), counted as :class:`~dflash_torch.batch.BatchDecoder` counts them before it
    allocates them."""
    B = block_size or (drafter.config.block_size if drafter is not None else 1)
    capacity, max_rows, draft_rows = cache_sizes(max_context, 256, B)
    return cache_bytes(target, drafter if drafter is not None and B > 1 else None, n, capacity, max_rows, False,
                       draft_rows)


def check_batch_fits(target: TargetModel, drafter: DFlashDrafter | None, n: int, max_context: int,
                     block_size: int | None = None) -> None:
    """Refuse a batch size whose caches (:func:`batch_caches_bytes`) would not fit in 90% of
    the device's free memory, as the batch decoder would, but before anything is timed and
    without allocating them.

    Raises:
        DFlashError: naming ``--batch-sizes`` and ``--max-new-tokens``.
    """
    device = target.model.embed_tokens.weight.device
    need, free = batch_caches_bytes(target, drafter, n, max_context, block_size), available_memory(device)
    if free is not None and need > 0.9 * free:
        most = most_that_fits(lambda m: batch_caches_bytes(target, drafter, n, m, block_size), max_context, 0.9 * free)
        raise DFlashError(f"--batch-sizes {n}: the caches of {n} sequences x {max_context} positions (the longest prompt "
                          f"+ --max-new-tokens) need {memory_text(need, True)} but {device.type} has "
                          f"{memory_text(free, True)} free; lower --batch-sizes or --max-new-tokens"
                          + (f" ({n} sequences of at most {most} positions fit in 90% of that)" if most else ""))


@torch.inference_mode()
def batch_size_bench(target: TargetModel, drafter: DFlashDrafter | None, prompt_ids: list[list[int]],
                     batch_sizes: list[int], max_new_tokens: int, block_size: int | None = None,
                     draft_max_batch_size: int | str | None = None, progress: bool = True,
                     max_context: int | None = None) -> list[dict]:
    """One row per (batch size, mode): ``mode`` ``"dflash"`` or ``"target-only"``,
    ``batch_size``, ``requests`` (:func:`requests_for`: the same at every batch size),
    ``aggregate_decode_tokens_per_second`` (decode tokens / decode time),
    ``aggregate_tokens_per_second`` (all generated tokens / wall time, prefills
    included), ``p50_latency_s`` / ``p95_latency_s`` per request, ``rounds``,
    ``target_only_rounds`` (dflash rows: the rounds of ``rounds`` run without drafts, by
    ``draft_max_batch_size``; None for target-only rows), ``mean_batch``,
    ``mean_acceptance_length``, ``speedup_vs_target_only`` (dflash rows: over target-only
    at the same batch size), ``scaling_vs_batch_1`` (aggregate decode tok/s over the same
    mode's at batch size 1, when 1 is measured) and ``outputs_identical_to_target_only``.
    A short warm-up run precedes each measurement. ``draft_max_batch_size``: DFlash
    rounds of more sequences run target-only (:class:`~dflash_torch.batch.BatchDecoder`).
    ``max_context``: the caches' (default: the longest prompt + ``max_new_tokens`` + 1, at
    most the target's). A figure that was not measured (with ``max_new_tokens`` 1 no round
    decodes: tok/s, tau, ratios) is None."""
    if max_context is None:
        max_context = _batch_max_context(target, prompt_ids, max_new_tokens)
    requests = requests_for(prompt_ids, batch_sizes)
    rows = []
    for n in batch_sizes:
        outputs = {}
        for mode, d in (("target-only", None), ("dflash", drafter)):
            if mode == "dflash" and drafter is None:
                continue
            batch = None  # (the last decoder's caches go before the next are allocated: check_batch_fits counts one)
            gc.collect()
            batch = _batch_decoder(target, d, n, max_context, block_size, draft_max_batch_size)
            serve_all(batch, prompt_ids[:n], min(8, max_new_tokens))  # warm-up
            r = serve_all(batch, requests, max_new_tokens)
            outputs[mode] = r.pop("outputs")
            lat = r.pop("latencies_s")
            if mode == "target-only":  # (no drafter: no round to run without drafts)
                r["target_only_rounds"] = None
            row = {"mode": mode, "batch_size": n, "requests": len(requests), **r,
                   "aggregate_decode_tokens_per_second": ratio(r["decode_tokens"], r["decode_s"]),
                   "aggregate_tokens_per_second": ratio(r["generated_tokens"], r["wall_s"]),
                   "p50_latency_s": _percentile(lat, 0.5), "p95_latency_s": _percentile(lat, 0.95),
                   "speedup_vs_target_only": None, "scaling_vs_batch_1": None,
                   "outputs_identical_to_target_only": None}
            rows.append(row)
            if progress:
                print(f"batch {n} {mode}: {fmt(row['aggregate_decode_tokens_per_second'], '.1f')} tok/s, "
                      f"p50 {row['p50_latency_s']:.2f} s, tau {fmt(row['mean_acceptance_length'], '.2f')}, "
                      f"mean batch {fmt(row['mean_batch'], '.2f')}", flush=True)
        if "dflash" in outputs:
            base = next(r for r in rows if r["batch_size"] == n and r["mode"] == "target-only")
            rows[-1]["speedup_vs_target_only"] = ratio(rows[-1]["aggregate_decode_tokens_per_second"],
                                                       base["aggregate_decode_tokens_per_second"])
            rows[-1]["outputs_identical_to_target_only"] = outputs["dflash"] == outputs["target-only"]
    for row in rows:
        one = next((r for r in rows if r["batch_size"] == 1 and r["mode"] == row["mode"]), None)
        if one is not None:
            row["scaling_vs_batch_1"] = ratio(row["aggregate_decode_tokens_per_second"],
                                              one["aggregate_decode_tokens_per_second"])
    return rows


def batch_table(rows: list[dict]) -> str:
    """The rows of :func:`batch_size_bench` as a markdown table (a dflash row's target-only
    rounds as "K of N", N its rounds; "-" for a target-only row)."""
    lines = ["| batch | mode | mean batch | target-only rounds | decode tok/s (aggregate) | x batch 1 | tok/s incl. prefill "
             "| p50 latency s | p95 latency s | tau | DFlash / target-only | vs target-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    same = {None: "-", True: "identical", False: "DIFFERS"}
    for r in rows:
        plain = "-" if r["target_only_rounds"] is None else f"{r['target_only_rounds']} of {r['rounds']}"
        lines.append(f"| {r['batch_size']} | {r['mode']} | {fmt(r['mean_batch'], '.2f')} | {plain} | "
                     f"{fmt(r['aggregate_decode_tokens_per_second'], '.1f')} | "
                     f"{fmt(r['scaling_vs_batch_1'], '.2f')} | {fmt(r['aggregate_tokens_per_second'], '.1f')} | "
                     f"{r['p50_latency_s']:.2f} | {r['p95_latency_s']:.2f} | {fmt(r['mean_acceptance_length'], '.2f')} | "
                     f"{fmt(r['speedup_vs_target_only'], '.2f')} | {same[r['outputs_identical_to_target_only']]} |")
    return "\n".join(lines)


def batch_plot(rows: list[dict], path) -> None:
    """Aggregate decode tok/s and p50 latency against batch size, one curve per mode (PNG)."""
    plt = pyplot()

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for mode, marker in (("dflash", "o"), ("target-only", "s")):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        sizes = [r["batch_size"] for r in rs]
        ax[0].plot(sizes, [r["aggregate_decode_tokens_per_second"] for r in rs], marker=marker, label=mode)
        ax[1].plot(sizes, [r["p50_latency_s"] for r in rs], marker=marker, label=f"{mode} p50")
        ax[1].plot(sizes, [r["p95_latency_s"] for r in rs], marker=marker, linestyle="--", label=f"{mode} p95")
    ax[0].set_xlabel("batch size (concurrent streams)")
    ax[0].set_ylabel("aggregate decode tokens/s")
    ax[0].set_title("Batched decoding throughput")
    ax[1].set_xlabel("batch size (concurrent streams)")
    ax[1].set_ylabel("per-request latency (s)")
    ax[1].set_title("Per-request latency")
    for a in ax:
        a.set_xscale("log", base=2)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
