"""``dflash-torch bench``: decoding modes side by side, the context sweep and
large-shape timing, in one process. Writes ``bench.json`` and PNG plots."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import compute
from ..errors import DFlashError, OptionError, first_line
from ..options import check_chat_template_kwargs, check_max_new_tokens, context_limit, n_tokens, resolve_device, resolve_dtype
from . import fmt, pyplot, ratio


DEFAULT_SWEEP = "128,512,2048,8192"  # (--sweep's context lengths where it is not given)


def register(sub) -> None:
    from ..cli import add_chat_template_kwargs_arg, add_model_args, int_or_auto, path_arg

    p = sub.add_parser("bench", help="benchmark target-only vs DFlash (inject / recompute, eager / compiled)")
    add_model_args(p, decoding=False)  # (bench picks the decoding with --modes)
    p.add_argument("--prompts", type=path_arg, default=None, help="JSONL prompt file of {\"prompt\": text} or {\"messages\": [...]} "
                   "lines, - for stdin (default: the shipped held-out code prompts)")
    p.add_argument("--chat", action="store_true",
                   help="apply the target tokenizer's chat template to each prompt (as a user message)")
    add_chat_template_kwargs_arg(p, "(with --chat)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts to use (default 16; 0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt, at least 2: the first comes from the prefill (default 256)")
    p.add_argument("--modes", default="target-only,inject,recompute,target-only-compiled,inject-compiled",
                   help="comma-separated: target-only, inject, recompute, target-only-compiled, inject-compiled "
                        "(default: all five)")
    p.add_argument("--sweep", default=None, help="context lengths of the propose-time sweep (default 128,512,2048,8192, "
                        "those past the target's context left out of its drafter's sweep, skipped for a --target "
                        "without --draft; '' = skip)")
    p.add_argument("--sweep-shapes", default="",
                   help="also sweep a randomly initialised 5-layer drafter of these target shapes, e.g. qwen3-1.7b ('' = skip)")
    p.add_argument("--shapes", default="",
                   help="large-shape timing on random weights, e.g. qwen3-1.7b,qwen3.5-9b,qwen3-30b-a3b ('' = skip); "
                        "targets too large for this machine time a layer subset, scaled to full depth")
    p.add_argument("--shapes-compiled", action="store_true",
                   help="also time each --shapes shape's step and round compiled as --compile runs them "
                        "(CUDA: CUDA graphs); needs every layer in memory")
    p.add_argument("--batch-sizes", default="",
                   help="batched decoding at these batch sizes, e.g. 1,2,4,8: aggregate tok/s and p50/p95 latency, "
                        "DFlash vs batched target-only ('' = skip; with it, --modes may be '')")
    p.add_argument("--draft-max-batch-size", type=int_or_auto, default=None, metavar="N|auto",
                   help="with --batch-sizes: DFlash rounds of more than N sequences run target-only, or with auto "
                        "where measured tokens/s favour it (as serve --draft-max-batch-size; default: always draft)")
    p.add_argument("--out", type=path_arg, default="bench_out", help="output directory for bench.json and plots (default bench_out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _lossless(r: dict) -> str:
    if r["outputs_identical_to_target_only"] is None:
        return "-"
    if not r["divergences"]:
        return "identical"
    gap = max(abs(d["logit_gap"]) for d in r["divergences"])
    return f"{len(r['divergences'])} differ (max gap {gap:.3f})"


def _table(rows: list[dict]) -> str:
    head = ["mode", "tok/s", "x target", "x target same compile", "tau", "propose ms", "verify ms", "other ms", "recompiles",
            "CUDA graphs skipped", "peak MB", "vs target-only"]
    lines = [head]
    for r in rows:
        lines.append([
            r["name"], fmt(r["decode_tokens_per_second"], ".1f"),
            fmt(r["speedup_vs_target_only"], ".2f"), fmt(r["speedup_vs_target_only_same_compile"], ".2f"),
            fmt(r["mean_acceptance_length"], ".2f"), f"{r['propose_time_per_round'] * 1e3:.2f}",
            f"{r['verify_time_per_round'] * 1e3:.2f}", f"{r['other_time_per_round'] * 1e3:.2f}",
            "-" if r["recompiles_after_warmup"] is None else str(r["recompiles_after_warmup"]),
            "-" if r["cudagraphs_skipped"] is None else str(r["cudagraphs_skipped"]),
            f"{r['peak_memory_mb']:.0f}",
            _lossless(r),
        ])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
    return "\n".join([line(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in lines[1:]])


def _layers_timed(sh: dict) -> str:
    if sh["scaled"]:
        return f"layers timed: {sh['layers_timed']} of {sh['layers']}, SCALED"
    return f"layers timed: {sh['layers']} of {sh['layers']}"


def _shapes_table(shapes: list[dict]) -> str:
    """The --shapes results as a markdown table, with the caveats spelled out under it."""
    from .shapes import PUBLISHED_TAU

    first = shapes[0]
    tau = "mean (paper, Qwen3-8B)"
    lines = [f"\nround vs step on random weights ({first['dtype']}, {first['device']}, context {first['context']}, "
             f"B={first['block_size']}, {first['draft_layers']}-layer drafter):",
             "| shape | model_type | step ms | round ms | propose ms | verify ms | round/step | round/step by weights read "
             f"| layers timed | experts hit / MoE layer (verify of {first['block_size']}) | PROJECTED speedup at tau "
             f"{PUBLISHED_TAU[tau]} |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for sh in shapes:
        hits = "-" if sh["experts_hit_per_moe_layer"] is None else \
            f"{sh['experts_hit_per_moe_layer']:.1f} of {sh['moe']['num_experts']} (top-{sh['moe']['top_k']})"
        timed = f"{sh['layers_timed']} of {sh['layers']}, SCALED" if sh["scaled"] else f"all {sh['layers']}"
        name = f"{sh['shape']} (compiled)" if sh.get("compiled") else sh["shape"]
        floor = "-" if sh["floor_round_over_step"] is None else f"{sh['floor_round_over_step']:.2f}"
        lines.append(f"| {name} | {sh['model_type']} | {sh['target_step_s'] * 1e3:.2f} | {sh['round_s'] * 1e3:.2f} | "
                     f"{sh['propose_s'] * 1e3:.2f} | {sh['verify_s'] * 1e3:.2f} | {sh['round_over_step']:.2f}"
                     f"{' UNRELIABLE' if sh.get('unreliable') else ''} | {floor} | "
                     f"{timed} | {hits} | "
                     f"{fmt(sh['projected_speedup'][tau], '.2f')}{'' if sh['projected_speedup'][tau] is None else 'x'} |")
    for sh in shapes:
        if sh.get("unreliable"):
            name = f"{sh['shape']} (compiled)" if sh.get("compiled") else sh["shape"]
            lines.append(f"{name}: {sh['unreliable']} (its PROJECTED speedup too)")
    if any(sh["scaled"] for sh in shapes):
        lines.append("SCALED rows: only whole periods of the layer pattern were built (the weights would not fit "
                     "comfortably in RAM); their per-layer time is scaled to the full depth (bench.json: 'measured').")
    if any(sh["floor_round_over_step"] is None for sh in shapes):
        lines.append("Round/step by weights read '-': a mixture-of-experts target, whose step reads the experts its "
                     "token is routed to, not weights known from the shape (bench.json: null).")
    if any(sh["projected_speedup"][tau] is None for sh in shapes):
        lines.append(f"PROJECTED '-': the paper's tau {PUBLISHED_TAU[tau]} (measured with blocks of 16) exceeds B; "
                     "a round of B tokens accepts at most B.")
    lines.append(f"PROJECTED = tau x step / round at the paper's tau ({tau}, B=16); the random models accept nothing. "
                 "Round/step by weights read = (bytes a step reads + bytes a propose reads) / step bytes: the "
                 "round/step of forwards that all run at the same fraction of the memory bandwidth.")
    return "\n".join(lines)


def _labelled_sweeps(report: dict) -> list[tuple[str, dict]]:
    """(label, sweep) for the loaded drafter's context sweep and each --sweep-shapes one."""
    sweeps = [("the loaded drafter", report["sweep"])] if report["sweep"] else []
    return sweeps + [(f"a {sw['shape']}-shaped {sw['draft_layers']}-layer drafter (random weights)", sw)
                     for sw in report["shape_sweeps"]]


def _left_out_line(left_out: list[int], limit: int, lengths: list[int]) -> str:
    """The line that says which of the default sweep's ``lengths`` the loaded drafter's sweep
    left out (``left_out``: those past the target's context of ``limit`` tokens)."""
    which = ", ".join(map(str, left_out))
    return (f"(the default sweep leaves out {which} for the loaded drafter: past the target's context of {limit} "
            f"tokens; --sweep {','.join(map(str, lengths))} times its propose there too)")


def drafting_modes(modes: list[dict]) -> list[dict]:
    """The modes of a report that draft (their acceptance histograms are plotted; a
    target-only mode's tau is always 1, one spike that would flatten every other curve)."""
    from .modes import ALL_MODES

    return [m for m in modes if ALL_MODES[m["name"]].drafter]


def _comma_list(value: str, flag: str) -> list[str]:
    """The items of ``flag``'s comma-separated ``value``, each stripped; ``[]`` for a value that
    is empty (or blank), which the options document as "none".

    Raises:
        DFlashError: an empty item (``128,,256``, a leading or a trailing comma), naming ``flag``.
    """
    if not value.strip():
        return []
    items = [x.strip() for x in value.split(",")]
    if "" in items:
        raise DFlashError(f"{flag} has an empty item in {value!r}: separate its items with single commas")
    return items


def _plot_files(modes: bool, sweeps: bool, batch_sizes: bool) -> list[str]:
    """The names of the plots a run writes in --out: with modes, sweeps, batch sizes."""
    return [name for name, on in (("modes.png", modes), ("sweep.png", sweeps), ("batch_sizes.png", batch_sizes)) if on]


def _write_report(report: dict, out: Path) -> None:
    """``report`` as ``out/bench.json``, whole or not at all: written beside it, then renamed
    over it (a full disk leaves an earlier run's file as it was).

    Raises:
        DFlashError: the file cannot be written (the tables are printed before).
    """
    path, part = out / "bench.json", out / "bench.json.part"
    try:
        part.write_text(json.dumps(report, indent=2))
        os.replace(part, path)
    except OSError as e:
        if part.is_file():
            part.unlink()
        raise DFlashError(f"cannot write {path}: {e.strerror} (the figures are printed above)") from None


def acceptance_bars(ax, modes: list[dict], block_size: int) -> None:
    """Draw the acceptance histograms of ``modes`` (bench.json ``modes[]`` entries; their
    ``acceptance_histogram`` maps tau, an int or its string, to rounds) on the matplotlib axes
    ``ax``: side-by-side bars at every tau from 1 to ``block_size`` (or the largest tau seen),
    a tau without rounds a bar of 0, the rounds axis from 0; a legend where a mode is drawn."""
    hists = [(m["name"], {int(k): n for k, n in m["acceptance_histogram"].items()}) for m in modes
             if m["acceptance_histogram"]]
    top = max([block_size, *(k for _, h in hists for k in h)])
    taus = list(range(1, top + 1))
    width = 0.8 / max(1, len(hists))
    for i, (name, h) in enumerate(hists):
        ax.bar([t - 0.4 + width * (i + 0.5) for t in taus], [h.get(t, 0) for t in taus], width=width, label=name)
    if top <= 20:  # (every tau labelled; larger blocks: matplotlib's integer ticks)
        ax.set_xticks(taus)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("acceptance length tau (tokens per round)")
    ax.set_ylabel("rounds")
    ax.set_title("Acceptance histogram")
    if hists:  # (target-only modes alone draw no bar)
        ax.legend()


def _plots(report: dict, out: Path) -> list[str]:
    plt = pyplot()

    files = []
    modes = report["modes"]
    if modes:
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        names = [m["name"] for m in modes]
        ax[0].bar(names, [m["decode_tokens_per_second"] or 0.0 for m in modes], color="tab:blue")  # (None: no bar)
        ax[0].set_ylabel("decode tokens/s")
        ax[0].set_title("Decode throughput")
        ax[0].tick_params(axis="x", rotation=30)
        acceptance_bars(ax[1], drafting_modes(modes), report.get("block_size") or 1)
        fig.tight_layout()
        fig.savefig(out / "modes.png", dpi=110)
        plt.close(fig)
        files.append(str(out / "modes.png"))
    sweeps = _labelled_sweeps(report)
    if sweeps:
        fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4), squeeze=False)
        for ax, (title, sweep) in zip(axes[0], sweeps):
            ax.plot(sweep["lengths"], [t * 1e3 for t in sweep["inject"]], marker="o", label="inject (persistent KV cache)")
            ax.plot(sweep["lengths"], [t * 1e3 for t in sweep["recompute"]], marker="s", label="recompute (cache-less)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("committed context (tokens)")
            ax.set_ylabel("propose time (ms)")
            ax.set_title(f"Propose time vs context:\n{title}")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "sweep.png", dpi=110)
        plt.close(fig)
        files.append(str(out / "sweep.png"))
    return files


def run(args: argparse.Namespace) -> int:
    """Run bench; a run that fails (a refusal, a model that does not load, Ctrl-C) removes
    the ``--out`` directories it made while they are still empty. Its files are its product:
    stdout that cannot take its tables (a reader that went away, a full disk) stops the
    printing only, and the files are still written (then: a broken pipe ends it quietly,
    status 0; any other failure is one line, status 1).

    Raises:
        OutputError: stdout is closed (before anything runs), or it failed (after the files
            are written).
    """
    from ..cli import missing_dirs, raise_stdout_error, stdout_kept_going

    made = missing_dirs(Path(args.out)) if args.out.strip() else []
    try:
        # all of bench's torch work (its engine's too) on this thread: one OpenMP thread team
        with stdout_kept_going() as stdout, compute.this_thread():
            code = _run(args)
        raise_stdout_error(stdout)
        return code
    except BaseException:
        for path in made:  # (the deepest first; a directory something was written into stays)
            try:
                path.rmdir()
            except OSError:
                pass
        raise


def _run(args: argparse.Namespace) -> int:
    from ..cli import set_threads, warn_compile
    from ..engine import DEFAULT_DRAFTER, DEFAULT_TARGET, ASSETS, DFlashEngine, is_shipped_target
    from ..hub import revision_of
    from .batching import batch_plot, batch_size_bench, batch_table, check_batch_fits
    from ..batch import check_draft_max_batch_size
    from .modes import ALL_MODES, divergences, load_prompts, run_modes
    from .shapes import SHAPES, build_drafter, layers_that_fit, round_vs_step
    from .shapes import drafter_config as shape_drafter_config, target_config
    from .sweep import check_sweep_fits, context_sweep

    set_threads(args)
    if args.draft is None and is_shipped_target(args.target):  # (named by its path: the shipped pair, as without it)
        args.target = None
    if isinstance(args.max_new_tokens, int) and args.max_new_tokens < 2:  # (no round to time, no tok/s or tau)
        raise DFlashError(f"--max-new-tokens must be >= 2 for bench, got {args.max_new_tokens}: the first token comes "
                          "from the prefill, so with fewer there is no decoding round to time")
    check_max_new_tokens(args.max_new_tokens, "--max-new-tokens")
    if args.prompts is not None and not args.prompts.strip():
        raise DFlashError("--prompts is empty; give a JSONL prompt file (or leave --prompts out for the shipped prompts)")
    if not args.out.strip():
        raise DFlashError("--out is empty; give an output directory (default bench_out)")
    device = resolve_device(args.device)  # (both checked again by from_pretrained; here before --out is created)
    args.device = str(device)  # (as torch spells it: CUDA -> cuda, which the shapes' timing reads)
    dtype = resolve_dtype(args.dtype, device=device)
    asked = args.num_prompts  # (None: not given, the default 16)
    if asked is not None and asked < 0:
        raise DFlashError(f"--num-prompts must be >= 0 (0 = all), got {asked}")
    given = [flag for flag, on in (("--no-draft", args.no_draft), ("--compile", args.compile),
                                   ("--draft-mode", args.draft_mode is not None)) if on]
    if given:
        raise DFlashError(f"bench picks target-only / inject / recompute / compiled runs with --modes; drop "
                          f"{', '.join(given[:-1]) + ' and ' if len(given) > 1 else ''}{given[-1]}")
    if args.max_context is not None:
        raise DFlashError("bench sizes the context from the prompts and --max-new-tokens; drop --max-context")
    if args.prefill_chunk is not None:
        raise DFlashError("bench times every mode at the default prefill chunk (256); drop --prefill-chunk")
    modes = _comma_list(args.modes, "--modes")
    batch_sizes = _comma_list(args.batch_sizes, "--batch-sizes")  # (before the try: a DFlashError is a ValueError)
    try:
        batch_sizes = [int(x) for x in batch_sizes]
    except ValueError:
        raise DFlashError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    if any(n < 1 for n in batch_sizes) or len(set(batch_sizes)) != len(batch_sizes):
        raise DFlashError(f"--batch-sizes must be distinct integers >= 1, got {args.batch_sizes!r}")
    batch_sizes.sort()  # (timed, reported and plotted in increasing order, as the --sweep lengths)
    if args.draft_max_batch_size is not None:
        check_draft_max_batch_size(args.draft_max_batch_size, block_size=args.block_size)
        if not batch_sizes:  # (the modes decode one sequence: nothing would use it)
            raise DFlashError("--draft-max-batch-size applies to --batch-sizes only; add --batch-sizes or drop it")
    if not modes and not batch_sizes:
        raise DFlashError("--modes is empty; choose from target-only, inject, recompute, target-only-compiled, inject-compiled "
                          "(an empty --modes times --batch-sizes only)")
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise DFlashError(f"unknown bench mode(s) {unknown}; choose from {', '.join(ALL_MODES)}")
    repeated = sorted({m for m in modes if modes.count(m) > 1})
    if repeated:
        raise DFlashError(f"--modes lists {', '.join(repeated)} more than once")
    shapes = _comma_list(args.shapes, "--shapes")
    sweep_shapes = _comma_list(args.sweep_shapes, "--sweep-shapes")
    bad = [s for s in shapes + sweep_shapes if s not in SHAPES]
    if bad:
        raise DFlashError(f"unknown shape(s) {bad}; choose from {', '.join(SHAPES)}")
    if args.shapes_compiled and not shapes:  # (nothing would be compiled)
        raise DFlashError("--shapes-compiled applies to --shapes only; add --shapes or drop it")
    for shape in shapes:  # a shape that cannot fit is refused before anything is timed
        fit = layers_that_fit(shape, dtype, args.device)[0]
        layers = target_config(shape).num_hidden_layers
        if args.shapes_compiled and fit < layers:
            raise DFlashError(f"--shapes-compiled times shape {shape} with all {layers} layers in memory; only {fit} "
                              f"fit on {args.device}: drop --shapes-compiled (or this shape)")
    sweep = DEFAULT_SWEEP if args.sweep is None else args.sweep  # (None: not given)
    lengths = _comma_list(sweep, "--sweep")
    try:
        lengths = [int(x) for x in lengths]
    except ValueError:
        raise DFlashError(f"--sweep must be comma-separated integers, got {args.sweep!r}") from None
    if any(n < 1 for n in lengths):
        raise DFlashError(f"--sweep context lengths must be >= 1, got {args.sweep!r}")
    if len(set(lengths)) != len(lengths):
        raise DFlashError(f"--sweep lists a context length more than once, got {args.sweep!r}")
    lengths.sort()  # (the table, the plot and the ratio go from the shortest to the longest)
    if sweep_shapes and not lengths:  # (nothing would be swept)
        raise DFlashError("--sweep-shapes sweeps the --sweep context lengths, and --sweep is empty; "
                          "give --sweep lengths or drop --sweep-shapes")
    if shapes or sweep_shapes:  # (they time a random drafter's blocks of bench's block size)
        flag = "--shapes" if shapes else "--sweep-shapes"
        if args.target is not None and args.draft is None:
            raise DFlashError(f"{flag} times DFlash rounds at the drafter's block size, and this target has no --draft: "
                              f"add --draft or drop {flag}")
        if args.block_size is not None and args.block_size < 2:
            raise DFlashError(f"{flag} times DFlash rounds of --block-size tokens, which must be >= 2, got "
                              f"{args.block_size}: raise --block-size or drop {flag}")
    if args.sweep is not None and lengths and args.target is not None and args.draft is None:
        # (the default sweep is skipped quietly for a target timed without a drafter; one asked for is not)
        raise DFlashError("--sweep times the drafter's propose at these context lengths, and this target has no "
                          "--draft: add --draft or drop --sweep")
    prompts = load_prompts(Path(args.prompts) if args.prompts else ASSETS / "prompts.jsonl",
                           16 if asked is None else asked or None)
    if args.chat_template_kwargs is not None and not args.chat and all(isinstance(p, str) for p in prompts):
        raise DFlashError("--chat-template-kwargs apply to chat prompts only: add --chat (or give {\"messages\": ...} "
                          "prompts)")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DFlashError(f"cannot use --out {out} as the output directory: {e.strerror}") from None
    # a target of the user's without a drafter can still be timed target-only
    needs_drafter = bool(batch_sizes) or any(ALL_MODES[m].drafter for m in modes)
    if args.target is not None and args.draft is None and needs_drafter:
        raise DFlashError("the drafting modes and --batch-sizes need --draft, this target's DFlash drafter checkpoint "
                          "(without one, --modes target-only,target-only-compiled time the target alone)")
    engine = DFlashEngine.from_pretrained(args.target, args.draft, dtype=args.dtype, device=args.device,
                                          block_size=args.block_size, mxfp4=args.mxfp4, fp8=args.fp8,
                                          int_weights=args.int_weights, nvfp4=args.nvfp4,
                                          no_draft=args.target is not None and args.draft is None)
    # (variables no prompt may set: the flag's fault, named as the flag, not the first prompt's)
    check_chat_template_kwargs(args.chat_template_kwargs, engine.reserved_template_variables())
    prompt_ids = []
    source = "<stdin>" if args.prompts == "-" else args.prompts or "the shipped prompt set"
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list) and not getattr(engine.tokenizer, "chat_template", None):
            # (the line's fault, not --chat's, which the engine's refusal names: trial-268)
            raise DFlashError(f"prompt {i + 1} of {source} is a {{\"messages\": [...]}} line, which needs a chat "
                              "template, and this model's tokenizer has none: give it as a {\"prompt\": text} line")
        try:  # (chat_template_kwargs apply to the chats only: --chat's, or {"messages"} prompts)
            chat = args.chat or isinstance(prompt, list)
            prompt_ids.append(engine.encode_prompt(prompt, args.chat, args.chat_template_kwargs if chat else None))
        except OptionError as exc:  # (a template that cannot render the variables: still naming the flag)
            raise OptionError(f"prompt {i + 1}: {exc}", *exc.names) from None
        except DFlashError as exc:  # (a message list the template or the checks refuse)
            raise DFlashError(f"prompt {i + 1}: {exc}") from None
    limit = context_limit(engine.target.config)
    for i, ids in enumerate(prompt_ids):  # (bench caps its caches at the target's context)
        if len(ids) + args.max_new_tokens > limit:
            raise DFlashError(f"prompt {i + 1} ({n_tokens(len(ids))}) + --max-new-tokens ({args.max_new_tokens}) exceeds "
                              f"the target's context of {limit} tokens")
    if asked and len(prompts) < asked:  # (said once the prompts are accepted)
        print(f"bench: {len(prompts)} prompt{'s' if len(prompts) > 1 else ''} in {args.prompts or 'the shipped set'}, "
              f"fewer than --num-prompts {asked}: timing {len(prompts)}", file=sys.stderr)
    max_context = min(limit, max(map(len, prompt_ids)) + args.max_new_tokens + 1)
    # the loaded drafter's sweep: the default's lengths past the target's context (8192 of the shipped pair's 4096)
    # are left out, said under its table (given ones are timed, with a note: the drafter's cost alone)
    left_out = [n for n in lengths if n > limit] if args.sweep is None and engine.drafter is not None else []
    pair_lengths = [n for n in lengths if n not in left_out] if engine.drafter is not None else []
    if batch_sizes:  # (the largest batch's caches: before anything is timed)
        check_batch_fits(engine.target, engine.drafter, max(batch_sizes), max_context, block_size=args.block_size)
    plots = _plot_files(bool(modes), bool(pair_lengths) or (bool(lengths) and bool(sweep_shapes)), bool(batch_sizes))
    for name in ["bench.json", "bench.json.part", *plots]:  # (a write that fails after the timing would lose the results)
        if (out / name).is_dir():
            raise DFlashError(f"cannot write {out / name}: it is a directory (bench writes its results there); "
                              "remove it or give another --out")
    if not os.access(out, os.W_OK):
        raise DFlashError(f"cannot write in --out {out}: permission denied")
    if lengths:  # (before anything is timed: a sweep that cannot fit was a traceback after the modes)
        if pair_lengths:
            check_sweep_fits(engine.drafter.config, pair_lengths, engine.block_size, dtype, device)
        for shape in sweep_shapes:
            check_sweep_fits(shape_drafter_config(target_config(shape), 5, engine.block_size), lengths,
                             engine.block_size, dtype, device, f"a {shape}-shaped drafter", built=False)
        beyond = [n for n in lengths if n > limit]
        if beyond and engine.drafter is not None and args.sweep is not None:  # (not for the default's 8192)
            print(f"note: --sweep lengths {', '.join(map(str, beyond))} exceed the target's context of {limit} tokens: "
                  "the loaded drafter's sweep times contexts this pair cannot reach (the cost alone)",
                  file=sys.stderr, flush=True)
    report = {
        "target": str(args.target or DEFAULT_TARGET), "draft": None if engine.drafter is None else str(args.draft or DEFAULT_DRAFTER),
        # (the commit of a Hub id's snapshot in the cache, ORG/NAME@main's too: main moves; null for a local directory)
        "target_revision": revision_of(args.target or DEFAULT_TARGET),
        "draft_revision": None if engine.drafter is None else revision_of(args.draft or DEFAULT_DRAFTER),
        "dtype": str(dtype).removeprefix("torch."), "device": args.device, "block_size": engine.block_size,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "greedy": True, "ignore_eos": True,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "modes": [], "sweep": None, "shape_sweeps": [], "shapes": [],
        "batch_sizes": [], "draft_max_batch_size": args.draft_max_batch_size,
        "chat": args.chat, "chat_template_kwargs": args.chat_template_kwargs,
        "prompt_tokens": [len(ids) for ids in prompt_ids],
        "mxfp4": "packed" if engine.target.config.keep_mxfp4 else ("dequantized" if engine.target.config.mxfp4 else None),
        "fp8": "packed" if engine.target.config.keep_fp8 else ("dequantized" if engine.target.config.fp8_block else None),
        "int_weights": "packed" if engine.target.config.keep_int else (
            "dequantized" if engine.target.config.int_quant else None),
        "nvfp4": "packed" if engine.target.config.keep_nvfp4 else (
            "dequantized" if engine.target.config.nvfp4 else None),
    }
    runs = [] if not modes else run_modes([ALL_MODES[name] for name in modes], engine.target, engine.drafter, prompt_ids,
                     block_size=args.block_size, max_new_tokens=args.max_new_tokens, max_context=max_context,
                     progress=not args.no_progress)
    by_name = {res.name: (res, outputs) for res, outputs in runs}
    reference = by_name.get("target-only")
    if reference is None and modes:
        print("note: no eager target-only mode in --modes: no speedup over it and no output identity check",
              file=sys.stderr, flush=True)
    for res, outputs in runs:
        spec = ALL_MODES[res.name]
        if reference is not None and res.name != "target-only":
            res.speedup_vs_target_only = ratio(res.decode_tokens_per_second, reference[0].decode_tokens_per_second)
            res.outputs_identical_to_target_only = outputs == reference[1]
            res.divergences = divergences(engine.target, prompt_ids, reference[1], outputs)
        # like-for-like: a DFlash mode against target-only run with the same compile setting
        base = by_name.get("target-only-compiled" if spec.compile else "target-only")
        if spec.drafter and base is not None:
            res.speedup_vs_target_only_same_compile = ratio(res.decode_tokens_per_second, base[0].decode_tokens_per_second)
        report["modes"].append(asdict(res))
        print(f"{res.name}: {fmt(res.decode_tokens_per_second, '.1f')} tok/s, tau {fmt(res.mean_acceptance_length, '.2f')}",
              flush=True)
        warn_compile(res.name, res.recompiles_after_warmup, res.cudagraphs_skipped, res.eager_fallbacks)
    if pair_lengths:
        report["sweep"] = context_sweep(engine.drafter, engine.target.model.embed_tokens, pair_lengths, engine.block_size)
    for shape in sweep_shapes if lengths else []:
        drafter, embed = build_drafter(shape, dtype, args.device, block_size=engine.block_size)
        report["shape_sweeps"].append({"shape": shape, "draft_layers": drafter.config.num_hidden_layers,
                                       **context_sweep(drafter, embed, lengths, engine.block_size)})
        del drafter, embed
    for shape in shapes:
        for compiled in (False, True) if args.shapes_compiled else (False,):
            report["shapes"].append(round_vs_step(shape, dtype, args.device, block_size=engine.block_size,
                                                  compiled=compiled))
            sh = report["shapes"][-1]
            label = f"{shape} compiled" if compiled else shape
            print(f"{label}: round/step {sh['round_over_step']:.2f} ({_layers_timed(sh)})"
                  + (f"; {sh['unreliable']}" if sh["unreliable"] else ""), flush=True)
            if compiled:
                warn_compile(label, sh["recompiles"], sh["cudagraph_skips"] if args.device.startswith("cuda") else None,
                             sh["eager_fallbacks"])
    if batch_sizes:
        report["batch_sizes"] = batch_size_bench(engine.target, engine.drafter, prompt_ids, batch_sizes,
                                                 args.max_new_tokens, block_size=args.block_size, max_context=max_context,
                                                 draft_max_batch_size=args.draft_max_batch_size,
                                                 progress=not args.no_progress)
    report["plots"] = [str(out / name) for name in plots]
    print()
    if report["modes"]:
        print(_table(report["modes"]))
    if report["batch_sizes"]:
        requests = report["batch_sizes"][0]["requests"]
        print(f"\nbatched decoding ({requests} requests of {args.max_new_tokens} tokens per batch size, greedy; "
              f"the {len(prompt_ids)} prompt{'s' if len(prompt_ids) > 1 else ''} cycled):")
        print(batch_table(report["batch_sizes"]))
    for label, s in _labelled_sweeps(report):
        print(f"\npropose time (ms) vs committed context, {label}:")
        print("| context | inject | recompute |\n|---|---|---|")
        for n, a, b in zip(s["lengths"], s["inject"], s["recompute"]):
            print(f"| {n} | {a * 1e3:.2f} | {b * 1e3:.2f} |")
        r = s["ratio_longest_over_shortest"]
        print(f"ratio {max(s['lengths'])}/{min(s['lengths'])}: inject {r['inject']:.2f}, recompute {r['recompute']:.2f}")
        if s is report["sweep"] and left_out:
            print(_left_out_line(left_out, limit, lengths))
    if left_out and report["sweep"] is None:  # (every default length past the context: no table to put it under)
        print("\n" + _left_out_line(left_out, limit, lengths))
    if report["shapes"]:
        print(_shapes_table(report["shapes"]))
    _write_report(report, out)  # (after the tables: a write that fails loses no figure)
    try:
        _plots(report, out)
        if batch_sizes:
            batch_plot(report["batch_sizes"], out / "batch_sizes.png")
    except (OSError, ImportError) as e:  # (the results are in bench.json already; it lists no plot then)
        report["plots"] = []
        _write_report(report, out)
        for name in ("modes.png", "sweep.png", "batch_sizes.png"):  # (an earlier run's, or one half written)
            (out / name).unlink(missing_ok=True)
        if isinstance(e, ImportError):  # (matplotlib not installed, or built for another numpy)
            raise DFlashError(f"wrote {out / 'bench.json'}, but cannot draw the plots: matplotlib cannot be imported "
                              f"({first_line(e)}); pip install --upgrade matplotlib") from None
        raise DFlashError(f"wrote {out / 'bench.json'}, but cannot write the plot {e.filename or out}: "
                          f"{e.strerror}") from None
    for name in {"modes.png", "sweep.png", "batch_sizes.png"} - set(plots):  # (an earlier run's, not of these results)
        if (out / name).is_file():
            (out / name).unlink()
    print(f"\nwrote {out / 'bench.json'} and {', '.join(report['plots'])}")
    return 0
