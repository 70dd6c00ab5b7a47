"""Time decoding modes on one model pair and one prompt set, in one process."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..decoding import SpeculativeDecoder, compile_counts, eager_fallbacks
from ..errors import DFlashError
from ..sampling import SamplingParams


@dataclass
class ModeSpec:
    """One decoding configuration: ``drafter`` False means target-only."""

    name: str
    drafter: bool
    draft_mode: str = "inject"
    compile: bool = False


ALL_MODES = {
    "target-only": ModeSpec("target-only", False),
    "inject": ModeSpec("inject", True, "inject"),
    "recompute": ModeSpec("recompute", True, "recompute"),
    "target-only-compiled": ModeSpec("target-only-compiled", False, compile=True),
    "inject-compiled": ModeSpec("inject-compiled", True, "inject", compile=True),
}


@dataclass
class ModeResult:
    """Figures of one mode over the prompt set (times in seconds).

    ``generated_tokens``: every token generated, over all prompts (each prompt's first, which
    its prefill makes, included, as ``generate --json`` and bench.json's ``batch_sizes`` count
    them); ``decode_tokens``: those the timed decoding rounds committed (without the first
    ones), which ``decode_tokens_per_second`` divides by ``decode_time``, and the acceptance
    lengths add up to.

    ``peak_memory_mb``: on CUDA the most memory allocated while this mode decoded; on
    CPU the process's peak resident set so far (it covers every mode built before).
    ``recompiles_after_warmup``: frames traced while decoding after the warm-up (compiled
    modes). ``cudagraphs_skipped``: compiled graphs of this mode that run without CUDA
    graphs (compiled modes on CUDA; None elsewhere): anything but 0 is a defect.
    ``eager_fallbacks``: compiled steps that reached torch's recompile limit while this
    mode warmed up or decoded, and so ran eager after it (compiled modes): anything but
    0 is a defect, and the mode's figures are not compiled figures.
    ``decode_tokens_per_second`` and ``mean_acceptance_length``: None where no decoding
    round ran (``max_new_tokens`` 1: every token came from a prefill).
    ``divergences``: where this mode's outputs differ from target-only's (:func:`divergences`:
    each entry's ``prompt`` counts from 1, as bench's messages name prompts).
    """

    name: str
    prompts: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0
    decode_time: float = 0.0
    decode_tokens_per_second: float | None = 0.0
    speedup_vs_target_only: float | None = None
    speedup_vs_target_only_same_compile: float | None = None
    rounds: int = 0
    mean_acceptance_length: float | None = 0.0
    acceptance_histogram: dict[int, int] = field(default_factory=dict)
    propose_time_per_round: float = 0.0
    verify_time_per_round: float = 0.0
    other_time_per_round: float = 0.0
    warmup_time: float = 0.0
    recompiles_after_warmup: int | None = None
    cudagraphs_skipped: int | None = None
    eager_fallbacks: int | None = None
    peak_memory_mb: float = 0.0
    outputs_identical_to_target_only: bool | None = None
    divergences: list[dict] = field(default_factory=list)


LABEL_FIELDS = ("id", "module")  # fields of a prompt line that label it (the shipped set's), read by no one


def load_prompts(path: Path, limit: int | None) -> list[str | list[dict]]:
    """Prompts from a JSONL file; ``-``: stdin. Each line is an object with a ``prompt`` or
    ``text`` field (a string), or a ``messages`` field (a null field counts as absent) (a chat: OpenAI's ``[{"role",
    "content"}, ...]``, which the engine renders with the target's chat template, as
    :meth:`~dflash_torch.DFlashEngine.encode_prompt` does; the messages themselves are
    checked there).

    Any other field (a sampling setting such as ``max_tokens`` or ``temperature``: bench decodes
    greedily, ``--max-new-tokens`` tokens per prompt) is ignored, with one WARNING line on stderr
    naming the fields and counting the lines among those returned that have them; but for
    :data:`LABEL_FIELDS`, the shipped set's labels, and null fields.

    Returns:
        the prompts, in file order, at most ``limit`` (None: all): strings, and message lists.

    Raises:
        DFlashError: a missing or unreadable file, one that is not UTF-8, a line that is not JSON or
            not an object with one of a non-empty string ``prompt`` / ``text`` and a non-empty
            list of objects ``messages``, text that is not valid Unicode, no prompt at
            all (naming the file and line).
    """
    path = Path(path)
    if str(path) == "-":  # (stdin, as Unix tools read "-")
        stdin = getattr(sys.stdin, "buffer", None)
        if stdin is None:
            raise DFlashError("prompt file - is stdin, which is closed")
        path, data = "<stdin>", stdin.read()
    elif path.is_dir():
        raise DFlashError(f"prompt file {path} is a directory; pass a JSONL file of {{\"prompt\": ...}} lines")
    elif not path.exists():
        raise DFlashError(f"prompt file {path} does not exist")
    else:
        try:  # (any readable file: a pipe such as /dev/stdin or a process substitution too)
            data = path.read_bytes()
        except OSError as e:
            raise DFlashError(f"cannot read prompt file {path}: {e.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = 1 + data.count(b"\n", 0, exc.start)
        raise DFlashError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    prompts, extras = [], []  # (extras: each prompt's fields besides its prompt)
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashError(f"{where}: not valid JSON ({exc.msg})") from None
        given = [k for k in ("prompt", "text", "messages") if obj.get(k) is not None] if isinstance(obj, dict) else []
        if not given:  # (a null field counts as absent, as train's records)
            raise DFlashError(f"{where}: expected a JSON object with a 'prompt' (or 'text') field, or 'messages'")
        if len(given) > 1:
            raise DFlashError(f"{where}: the object has {' and '.join(map(repr, given))}: which is the prompt? keep one")
        if given == ["messages"]:
            prompt = obj["messages"]
            if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
                raise DFlashError(f"{where}: 'messages' must be a non-empty list of chat messages "
                                  f"({{\"role\": ..., \"content\": ...}} objects), got {_short(prompt)}")
        else:
            prompt = obj[given[0]]
            if not isinstance(prompt, str) or not prompt:
                raise DFlashError(f"{where}: the prompt must be a non-empty string, got {_short(prompt)}")
        try:  # (a JSON escape such as \ud800 decodes to a lone surrogate, which no tokenizer takes)
            json.dumps(prompt, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise DFlashError(f"{where}: the prompt is not valid Unicode text (a lone surrogate escape)") from None
        prompts.append(prompt)
        extras.append([k for k in obj if k not in ("prompt", "text", "messages", *LABEL_FIELDS) and obj[k] is not None])
    if not prompts:
        raise DFlashError(f"{path} has no prompts")
    kept = extras[:limit] if limit else extras
    ignored = sorted({k for keys in kept for k in keys})
    if ignored:
        lines = sum(1 for keys in kept if keys)
        print(f"WARNING: {path}: bench ignores the field{'s' if len(ignored) > 1 else ''} "
              f"{', '.join(map(repr, ignored))} ({lines} line{'s' if lines > 1 else ''}): it decodes greedily, "
              "--max-new-tokens tokens per prompt", file=sys.stderr, flush=True)
    return prompts[:limit] if limit else prompts


def _short(value, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters (for an error message)."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_modes(specs: list[ModeSpec], target, drafter, prompt_ids: list[list[int]], *, block_size: int | None,
              max_new_tokens: int, max_context: int, warmup_prompts: int = 1,
              progress: bool = True) -> list[tuple[ModeResult, list[list[int]]]]:
    """Greedy-decode every prompt with ``max_new_tokens`` (EOS ignored) in each mode.

    Every mode is built and warmed up first; then each prompt is decoded in every mode
    in turn, so a slow spell of a shared machine hits all modes alike and the ratios
    between modes hold even when absolute speeds drift. Recompiles are counted per
    mode around its own decodes.

    ``warmup_prompts``: warm-up passes per mode (the longest prompt's prefill and the
    shortest prompt decoded to ``max_context``), after which a compiled mode has built
    the graphs of every length bucket up to ``max_context``. With 0, nothing is warmed
    up: compiled modes compile while timed (and count it as recompiles). ``progress``: a
    progress bar of the prompts on stderr, where that is a terminal.

    Returns:
        per mode, in the order of ``specs``: its figures and the generated ids of each prompt.
    """
    dev = target.model.embed_tokens.weight.device
    params = SamplingParams()
    decoders, results = [], []
    for spec in specs:
        decoder = SpeculativeDecoder(target, drafter if spec.drafter else None,
                                     block_size=block_size if spec.drafter else None,
                                     draft_mode=spec.draft_mode, compile=spec.compile, max_context=max_context)
        t0 = time.perf_counter()
        skips, fallbacks = compile_counts()[1], eager_fallbacks()
        # warm-up: a compiled mode first calls each compiled step at every length bucket up
        # to the context (SpeculativeDecoder.warmup); which buckets a decode reaches depends
        # on its acceptance lengths, so decoding prompts alone may miss one (its graph would
        # then be built in a timed decode). Then the longest prompt's prefill and the shortest
        # prompt decoded to the context limit run every mode's rounds as the timed decodes do.
        if spec.compile and warmup_prompts:
            decoder.warmup(max_context)
        longest, shortest = max(prompt_ids, key=len), min(prompt_ids, key=len)
        for _ in range(warmup_prompts):
            list(decoder.rounds(longest, params, min(2 * decoder.block_size, max_context - len(longest))))
            list(decoder.rounds(shortest, params, max_context - len(shortest)))
        decoders.append(decoder)
        graphed = spec.compile and dev.type == "cuda"
        results.append(ModeResult(spec.name, warmup_time=time.perf_counter() - t0,
                                  recompiles_after_warmup=0 if spec.compile else None,
                                  cudagraphs_skipped=compile_counts()[1] - skips if graphed else None,
                                  eager_fallbacks=eager_fallbacks() - fallbacks if spec.compile else None))
    outputs = [[] for _ in specs]
    rounds = [[] for _ in specs]
    # (None: no bar where stderr is not a terminal, a log file filled with its \r-separated redraws: trial-284)
    for ids in tqdm(prompt_ids, desc="decode", disable=None if progress else True, leave=False):
        for i, (spec, decoder, res) in enumerate(zip(specs, decoders, results)):
            graphs, skips = compile_counts()
            fallbacks = eager_fallbacks()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            out, rnds = [], []
            for rnd in decoder.rounds(ids, params, max_new_tokens):
                if rnd.acceptance_length is not None:  # (the last round's tau: the tokens kept)
                    rnd = replace(rnd, acceptance_length=min(rnd.acceptance_length, max_new_tokens - len(out)))
                out.extend(rnd.tokens)
                rnds.append(rnd)
            if spec.compile:
                res.recompiles_after_warmup += compile_counts()[0] - graphs
                res.eager_fallbacks += eager_fallbacks() - fallbacks
            if res.cudagraphs_skipped is not None:
                res.cudagraphs_skipped += compile_counts()[1] - skips
            outputs[i].append(out[:max_new_tokens])
            rounds[i].append(rnds)
            res.peak_memory_mb = max(res.peak_memory_mb, _peak_memory_mb(dev))
    for res, mode_rounds, mode_outputs in zip(results, rounds, outputs):
        decoding = [r for rnds in mode_rounds for r in rnds[1:]]  # without the prefill steps
        taus = [r.acceptance_length for r in decoding]
        total = sum(r.total_time for r in decoding)
        res.prompts = len(prompt_ids)
        res.generated_tokens = sum(map(len, mode_outputs))
        res.decode_tokens = res.generated_tokens - len(mode_outputs)  # (each prompt's first: its prefill's)
        res.decode_time = total
        res.decode_tokens_per_second = res.decode_tokens / total if taus and total else None
        res.rounds = len(taus)
        res.mean_acceptance_length = sum(taus) / len(taus) if taus else None
        res.acceptance_histogram = dict(sorted(Counter(taus).items()))
        if taus:
            res.propose_time_per_round = sum(r.propose_time for r in decoding) / len(taus)
            res.verify_time_per_round = sum(r.verify_time for r in decoding) / len(taus)
            res.other_time_per_round = total / len(taus) - res.propose_time_per_round - res.verify_time_per_round
    return list(zip(results, outputs))


@torch.inference_mode()
def divergences(target, prompt_ids: list[list[int]], reference: list[list[int]], outputs: list[list[int]]) -> list[dict]:
    """Where greedy outputs differ from the target-only reference (README.md: in bf16 a
    batched verify can flip near-ties; report them instead of hiding them).

    For each differing prompt: the first differing index (generated tokens), both tokens
    and the logit gap ``logit[reference token] - logit[other token]`` of a fresh target
    forward over prompt + the common prefix, in the model's dtype. A gap near zero (a few
    bf16 ulps) is a near-tie flip; a large gap would be a bug.

    Returns:
        ``[{"prompt": i, "index": j, "reference_token": a, "token": b, "logit_gap": g}, ...]``:
        ``prompt`` counts from 1 (the first of ``prompt_ids`` is 1, as bench's messages name
        prompts: "prompt 1 (...)"); ``index`` counts the prompt's generated tokens from 0 (the
        prefill's is 0); ``logit_gap`` a float.
    """
    found = []
    for i, (ids, ref, out) in enumerate(zip(prompt_ids, reference, outputs)):
        j = next((k for k, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if j is None:
            continue
        seq = torch.tensor(ids + ref[:j], dtype=torch.long, device=target.model.embed_tokens.weight.device)
        cache = target.new_cache()
        cache.reset(seq.shape[0])
        logits, _ = target(seq, torch.arange(seq.shape[0], device=seq.device), cache, seq.shape[0], logits_from=seq.shape[0] - 1)
        gap = float(logits[-1, ref[j]].float() - logits[-1, out[j]].float())
        found.append({"prompt": i + 1, "index": j, "reference_token": ref[j], "token": out[j], "logit_gap": gap})
    return found
