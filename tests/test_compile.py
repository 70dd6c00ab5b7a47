"""Fixed-shape rounds: same output as the eager loop, and zero recompilations after
warm-up under torch.compile while acceptance lengths and the context length vary.

Recompilation is decided by TorchDynamo's guards, before any backend runs, so the
test uses the cheap "eager" backend; the inductor backend sees the same graphs.
"""

import threading

import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils

from conftest import run_rounds

from dflash_torch.decoding import SpeculativeDecoder
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.target import TargetModel


def _load(pair):
    target_dir, drafter_dir = pair
    return TargetModel.from_pretrained(target_dir, torch.float32), DFlashDrafter.from_pretrained(drafter_dir, torch.float32)


def test_static_rounds_match_eager(agree_pair):
    target, drafter = _load(agree_pair)
    prompts = [[5, 17, 99, 3], list(range(2, 40)), [7] * 70]
    for B in (4, 16):
        eager = SpeculativeDecoder(target, drafter, block_size=B)
        static = SpeculativeDecoder(target, drafter, block_size=B, static=True, max_context=256, prefill_chunk=32)
        for p in prompts:
            assert run_rounds(static, p, 60) == run_rounds(eager, p, 60)
        # up to the context limit: the rounds cross from the 256-key bucket into the 512 one
        assert static.kv_bucket(200) == 256 and static.kv_bucket(257) == 512
        assert run_rounds(static, prompts[1], 256 - 38) == run_rounds(eager, prompts[1], 256 - 38)


def test_compiled_rounds_do_not_recompile(agree_pair):
    target, drafter = _load(agree_pair)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()  # (reset() leaves the counters of earlier tests)
    compiled = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=512, prefill_chunk=32)
    eager = SpeculativeDecoder(target, drafter)
    # warm-up to the context limit: compiles the prefill once (one chunk, 256-key bucket)
    # and propose and verify once per length bucket (256, 512 and the 768-token buffer):
    # the first round (no verify yet) must reuse the steady-state graphs
    run_rounds(compiled, [5, 17, 99, 3], 500)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    frames = dynamo_utils.counters["frames"]["total"]
    assert graphs == 1 + 2 * 3
    all_taus = []
    for prompt in ([11, 12, 13], list(range(2, 80)), [9] * 33):
        out, taus = run_rounds(compiled, prompt, 200)
        assert out == run_rounds(eager, prompt, 200)[0]
        all_taus += taus
    assert len(set(all_taus)) >= 3, f"acceptance lengths should vary, got {sorted(set(all_taus))}"
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, "a graph was recompiled after warm-up"
    assert dynamo_utils.counters["frames"]["total"] == frames, "a frame was re-traced after warm-up"


def test_recompute_mode_refuses_fixed_shapes(tiny_pair):
    import pytest

    from dflash_torch.errors import DFlashError

    target, drafter = _load(tiny_pair)
    with pytest.raises(DFlashError, match="recompute"):
        SpeculativeDecoder(target, drafter, draft_mode="recompute", compile=True)


def test_inductor_compiled_rounds_are_lossless(agree_pair):
    """The real CPU path of ``--compile``: the inductor backend."""
    target, drafter = _load(agree_pair)
    torch._dynamo.reset()
    compiled = SpeculativeDecoder(target, drafter, compile=True, max_context=256, prefill_chunk=32)
    baseline = SpeculativeDecoder(target, None)  # target-only, eager
    for prompt in ([5, 17, 99, 3], list(range(2, 40))):
        out, taus = run_rounds(compiled, prompt, 60)
        assert out == run_rounds(baseline, prompt, 60)[0]
        assert max(taus) > 1


def test_engine_warmup_builds_the_graphs_of_short_requests(agree_pair):
    from dflash_torch import DFlashEngine

    target_dir, drafter_dir = agree_pair
    torch._dynamo.reset()
    dynamo_utils.counters.clear()  # (reset() leaves the counters of earlier tests)
    # (prefill_chunk 32: the first bucket's graphs are those of test_inductor_compiled_rounds_are_lossless,
    # which inductor's cache then holds when the file runs in order)
    engine = DFlashEngine.from_pretrained(target_dir, drafter_dir, compile=True, max_context=256, prefill_chunk=32)
    assert engine.warmup() > 0
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs >= 3  # prefill, propose (with the injection of the last round's rows), verify
    out = engine.generate([5, 17, 99, 3], max_new_tokens=40, ignore_eos=True)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    reference = DFlashEngine.from_pretrained(target_dir, no_draft=True)
    assert out.token_ids == reference.generate([5, 17, 99, 3], max_new_tokens=40, ignore_eos=True).token_ids


def test_warmup_builds_the_round_graphs_even_in_a_tiny_context(agree_pair):
    """``warmup`` runs a decoding round whenever the context has room for one (3 tokens:
    a prompt token and two generated): with ``--max-context 3`` its prompt filled the
    context but one token, so no round ran, and ``serve --compile``'s first request
    compiled the round graphs (10-20 s on this CPU)."""
    from dflash_torch import DFlashEngine

    target, drafter = _load(agree_pair)
    spec = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True)
    for max_context in (3, 9):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        engine = DFlashEngine(target, spec.tokenizer, drafter, max_context=max_context, compile=True,
                              compile_backend="eager")
        engine.warmup()
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        out = engine.generate([5], max_new_tokens=2, ignore_eos=True)
        assert out.stats.acceptance_lengths  # a round ran
        assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs, f"max_context {max_context}: compiled after warm-up"


def test_eager_fallbacks_counts_a_function_past_the_recompile_limit():
    """eager_fallbacks() reads torch's own record of a function that reached the recompile
    limit (it then runs eager): checked on the installed torch, with a throwaway function."""
    from dflash_torch.decoding import eager_fallbacks

    def scale(x, k: int):
        return x * k

    before = eager_fallbacks()
    with torch._dynamo.config.patch(recompile_limit=2):
        fn = torch.compile(scale, backend="eager", dynamic=False)
        for k in range(3):  # an int argument specializes: one graph per value
            assert fn(torch.ones(2), k).tolist() == [k, k]
    assert eager_fallbacks() == before + 1


def test_compiled_decoders_keep_a_graph_per_bucket_past_the_recompile_limit(agree_pair):
    """A compiled decoder needs one graph per length bucket (times batch bucket), which can
    be more than torch's recompile limit: it reserves them, so none of its steps falls back
    to eager. Here the limit is lowered to 2 and each decoder needs 3 or 4 graphs per step."""
    from dflash_torch.batch import BatchDecoder
    from dflash_torch.decoding import eager_fallbacks, length_buckets

    target, drafter = _load(agree_pair)
    torch._dynamo.reset()
    before = eager_fallbacks()
    with torch._dynamo.config.patch(recompile_limit=2):
        single = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=600,
                                    prefill_chunk=32)
        assert length_buckets(single.target_cache.capacity) == 3  # 256, 512 and the 640-token buffer
        frames = dynamo_utils.counters["frames"]["ok"]
        for p, n in ((240, 30), (500, 90)):  # decoding past the ends of the 256 and 512 buckets
            prompt = [(7 * i) % 300 + 2 for i in range(p)]
            assert run_rounds(single, prompt, n)[0] == run_rounds(SpeculativeDecoder(target, drafter), prompt, n)[0]
        # prefill in the 256 and 512 buckets, propose and verify in all 3, all compiled
        # (frames "ok"; one given up is counted in "total" only)
        assert dynamo_utils.counters["frames"]["ok"] - frames == 2 + 2 * 3
        batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=200, compile=True, compile_backend="eager")
        frames = dynamo_utils.counters["frames"]["ok"]
        assert batch.warmup() == 2 * 2  # batch buckets 1, 2 x length buckets 256 and the 457-token buffer
        assert dynamo_utils.counters["frames"]["ok"] - frames == 2 * 4
    assert eager_fallbacks() == before


def test_compiled_steps_raise_the_recompile_limit_in_the_thread_that_calls_them(agree_pair):
    """torch keeps a config value set in one thread to that thread: a decoder built in one
    thread and driven in another (the compute thread, as compute.run advises) compiled with
    the other thread's limit (torch's default, 8), and a step that needed more graphs ran
    eager from then on (trial-185). Its steps now apply the reservation, and the cache tag,
    in the thread that calls them. Here the driving thread's own limit is 2 and each step
    needs 3 graphs."""
    from dflash_torch import decoding
    from dflash_torch.decoding import eager_fallbacks, tag_compile_caches

    target, drafter = _load(agree_pair)
    torch._dynamo.reset()
    before = eager_fallbacks()
    single = SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager", max_context=600,
                                prefill_chunk=32)
    frames = dynamo_utils.counters["frames"]["ok"]
    seen = {}

    def drive():
        config = torch._dynamo.config
        config.recompile_limit = 2  # this thread's own setting
        for p, n in ((240, 30), (500, 90)):  # decoding past the ends of the 256 and 512 buckets
            run_rounds(single, [(7 * i) % 300 + 2 for i in range(p)], n)
        seen.update(limit=config.recompile_limit, tag=torch.compiler.config.cache_key_tag)

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    assert seen["limit"] >= decoding._graphs_reserved >= 3 and seen["tag"] == tag_compile_caches()
    assert dynamo_utils.counters["frames"]["ok"] - frames == 2 + 2 * 3  # prefill 2, propose and verify 3 each
    assert eager_fallbacks() == before


def test_warmup_builds_every_bucket_up_to_its_context(agree_pair, agree_hybrid_pair):
    """SpeculativeDecoder.warmup(context) builds the prefill, propose, verify (and a hybrid
    target's commit) graphs of every length bucket a sequence of up to ``context`` tokens
    reaches: decoding prompts of 240 and 500 tokens past the ends of the 256 and 512
    buckets then builds none, and gives the eager decoder's tokens (an attention target,
    DFlash and target-only, and a hybrid target)."""
    for pair in (agree_pair, agree_hybrid_pair):
        target, drafter = _load(pair)
        torch._dynamo.reset()
        for d in (drafter, None) if pair is agree_pair else (drafter,):  # DFlash; target-only (block size 1)
            compiled = SpeculativeDecoder(target, d, compile=True, compile_backend="eager", max_context=600,
                                          prefill_chunk=64)
            assert compiled.warmup(600) == 3  # 256, 512 and the 640-token buffer
            frames = dynamo_utils.counters["frames"]["total"]
            eager = SpeculativeDecoder(target, d)
            for p, n in ((240, 30), (500, 90)):  # decoding past the ends of the 256 and 512 buckets
                prompt = [(7 * i) % 300 + 2 for i in range(p)]
                assert run_rounds(compiled, prompt, n)[0] == run_rounds(eager, prompt, n)[0]
            assert dynamo_utils.counters["frames"]["total"] == frames, "a graph was built after warmup()"
    not_compiled = SpeculativeDecoder(target, drafter, static=True, max_context=600)
    assert not_compiled.warmup(600) == 0


def test_engine_warmup_context(agree_pair):
    """DFlashEngine.warmup(context=...) warms the single-sequence decoder, and
    warmup(batch=True, context=...) the batch decoder (as a server that batches needs, the
    single-sequence one only as far as its short generation goes), up to that context: then
    a 300-token request builds no graph, alone or in a batch; a bad context is refused."""
    import pytest

    from dflash_torch import DFlashEngine, DFlashError

    target, drafter = _load(agree_pair)
    spec = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True)
    torch._dynamo.reset()
    engine = DFlashEngine(target, spec.tokenizer, drafter, max_context=400, compile=True, compile_backend="eager",
                          max_batch_size=2)
    with pytest.raises(DFlashError, match="context must be an integer >= 1, got 0"):
        engine.warmup(context=0)
    engine.warmup(context=400)
    engine.warmup(batch=True, context=400)
    frames = dynamo_utils.counters["frames"]["total"]
    prompt = list(range(2, 30))
    out = engine.generate(prompt, max_new_tokens=300, ignore_eos=True)
    batched = engine.generate_batch([prompt, [7, 8, 9]], max_new_tokens=300, ignore_eos=True)
    assert dynamo_utils.counters["frames"]["total"] == frames, "a graph was built after warmup(context=400)"
    assert batched[0].token_ids == out.token_ids == spec.generate(prompt, max_new_tokens=300, ignore_eos=True).token_ids


def test_compile_caches_are_tied_to_the_custom_operators_schemas(tiny_pair):
    """A compiled decoder tags torch.compile's cache keys with a hash of every
    ``dflash_torch::`` operator's schema (after a tag of the user's own): inductor's keys
    do not cover a custom operator's schema, and code cached against an older signature
    (an argument since renamed) was loaded again and failed ("Unknown keyword argument
    'gate_up_scales_2' for operator 'dflash_torch::dispatch_experts'"). Another schema gives
    another tag; the same schemas the same one."""
    from dflash_torch.decoding import tag_compile_caches

    config = torch.compiler.config
    saved = config.cache_key_tag
    try:
        config.cache_key_tag = "mine"
        target = TargetModel.from_pretrained(tiny_pair[0], torch.float32)
        drafter = DFlashDrafter.from_pretrained(tiny_pair[1], torch.float32)
        SpeculativeDecoder(target, drafter, compile=True, compile_backend="eager")
        tag = config.cache_key_tag
        assert tag.startswith("mine+dflash_torch-ops-") and tag_compile_caches() == tag
        lib = torch.library.Library("dflash_torch", "FRAGMENT")
        lib.define("tag_probe(Tensor x) -> Tensor")  # (as if an operator's schema changed)
        try:
            assert tag_compile_caches() not in (tag, "mine")
        finally:
            lib._destroy()
        assert tag_compile_caches() == tag
    finally:
        config.cache_key_tag = saved


def test_engine_default_warmup_covers_short_sequences_past_the_first_bucket(agree_pair):
    """DFlashEngine.warmup() (context 256) builds every graph a sequence of up to 256 tokens
    reaches, the second bucket's too: a prefill chunk after a reused prefix (chunk padded to
    256 rows from the reuse offset: the 512-key bucket) and the last rounds of a 250-token
    sequence (a block past 256 keys). It built only the first bucket's, so a chat's second
    turn compiled (1.2 s for the tiny pair, 10-30 s on a real model).
    warmup(batch=True), a server's, builds the same buckets for every batch size: those
    250-token sequences, one and two at a time, build no graph either (it stopped at 256
    keys, so a server's first requests of 250 tokens compiled: trial-268).
    A server of that engine logs a request's round past those buckets, which builds
    graphs while every stream waits, in one line (the round's shape, its seconds) and
    counts it in /metrics; the same request again builds nothing (trial-268: invisible).
    The batch decoder compiles with the engine's compile_backend (it took inductor's)."""
    import logging
    import re

    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from dflash_torch import DFlashEngine
    from dflash_torch.serving.app import create_app

    target, drafter = _load(agree_pair)
    spec = DFlashEngine.from_pretrained(agree_pair[0], no_draft=True)
    torch._dynamo.reset()
    built = []  # graphs handed to the backend: torch.compile's "eager" one, counting them

    def eager(gm, example_inputs):
        built.append(gm)
        return gm.forward

    engine = DFlashEngine(target, spec.tokenizer, drafter, max_context=512, compile=True, compile_backend=eager,
                          max_batch_size=2)
    engine.warmup()
    frames = dynamo_utils.counters["frames"]["total"]
    first = engine.generate(list(range(2, 30)), max_new_tokens=20, ignore_eos=True)
    again = engine.generate(list(range(2, 30)) + first.token_ids + [5, 6, 7], max_new_tokens=20, ignore_eos=True)
    assert again.stats.cached_prompt_tokens > 0  # (a reused prefix: the prefill chunk starts past 0)
    prompt = [(7 * i) % 300 + 2 for i in range(200)]
    long = engine.generate(prompt, max_new_tokens=50, ignore_eos=True)
    assert dynamo_utils.counters["frames"]["total"] == frames, "a graph was built after warmup()"
    assert long.token_ids == spec.generate(prompt, max_new_tokens=50, ignore_eos=True).token_ids
    graphs = len(built)
    engine.warmup(batch=True)
    assert len(built) > graphs  # (the batch decoder's graphs, by the engine's backend)
    frames = dynamo_utils.counters["frames"]["total"]
    for k in (1, 2):  # batch buckets 1 and 2, their last rounds past 256 keys
        outs = engine.generate_batch([prompt] * k, max_new_tokens=50, ignore_eos=True)
        assert [o.token_ids for o in outs] == [long.token_ids] * k
    assert dynamo_utils.counters["frames"]["total"] == frames, "a graph was built after warmup(batch=True)"

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    def serve(slots: int) -> list[tuple[float, bool]]:
        """Two requests of a 480-token prompt (its last rounds pass 512 keys: the 769-position
        cache's bucket) to a server of ``slots`` slots -> /metrics' compiles after each."""
        app, counted = create_app(engine, max_batch_size=slots), []
        try:
            client = TestClient(app)
            for _ in range(2):
                r = client.post("/v1/completions", json={"model": engine.name, "prompt": [(5 * i) % 300 + 2 for i in range(480)],
                                                         "max_tokens": 30, "ignore_eos": True})
                assert r.status_code == 200, r.text
                m = {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}
                counted.append((m["dflash_serving_compiles_total"], m["dflash_serving_compile_seconds_total"] > 0))
        finally:
            app.state.scheduler.close()
        return counted

    lines, handler = [], Lines()
    logging.getLogger("dflash_torch.serving").addHandler(handler)
    try:
        assert serve(2) == [(1, True), (1, True)]  # the batched backend
        assert len(lines) == 1 and lines[0].startswith("compiled the graphs of a round of 1 sequence (1 row, 769 keys) "
                                                       "while serving: "), lines
        lines.clear()
        assert serve(1) == [(1, True), (1, True)]  # the one-slot backend (the single-sequence decoder)
    finally:
        logging.getLogger("dflash_torch.serving").removeHandler(handler)
    got = re.match(r"compiled the graphs of a round of the one sequence at (\d+) tokens of context \((\d+) keys\) "
                   r"while serving: [\d.]+ s, every stream waiting", lines[0])
    n = int(got[1])  # (its first round past 512 keys: the block of 16 from position n - 1 reaches past them)
    assert len(lines) == 1 and 512 < n - 1 + 16 <= 512 + 16 and int(got[2]) == engine.decoder.kv_bucket(n - 1 + 16), lines


def test_a_graph_torch_fails_to_build_is_one_line_not_a_traceback(tiny_pair, tmp_path):
    """A truncated file in inductor's compile cache (a 0-byte ``.so`` that an interrupted
    compile left: ``ImportError: ... file too short``) made ``--compile`` print torch's
    140-line traceback. A graph torch fails to build is now one line with torch's reason,
    the remedy (the cache to remove; here the compiler to install) and ``--compile``; exit status 1. Inductor fails here for real, and
    cheaply: no working C++ compiler (``CXX=/bin/false``), in a cache of this test's own."""
    import os
    import subprocess
    import sys

    target, drafter = tiny_pair
    cache = tmp_path / "inductor"
    env = dict(os.environ, CXX="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dflash_torch", "generate", "x", "--compile", "--max-context", "64",
                           "--max-new-tokens", "2", "--target", str(target), "--draft", str(drafter)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("dflash-torch: error: compiling the decoding graphs failed: InvalidCxxCompiler: "), \
        proc.stderr
    assert "install one (g++) or set CXX to it; or run without compiling (no --compile" in proc.stderr, proc.stderr



def test_a_damaged_compile_cache_is_named_with_its_remedy():
    """Inductor's failure to load what its cache holds (a 0-byte ``.so`` an interrupted compile
    left: ``ImportError: ... file too short``, as torch raises it) names the cache to remove;
    another backend's failure gives torch's reason alone."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from dflash_torch.decoding import compile_failure

    def inductor():
        pass

    damaged = BackendCompilerFailed(inductor, ImportError("/c/x.main.so: file too short"), None)
    assert compile_failure(damaged) == (
        "compiling the decoding graphs failed: ImportError: /c/x.main.so: file too short; a damaged compile cache can "
        f"cause this: remove {cache_dir()} (torch inductor's cache, TORCHINDUCTOR_CACHE_DIR); or run without compiling "
        "(no --compile; bench: its modes without -compiled)")

    def other():
        pass

    assert compile_failure(BackendCompilerFailed(other, ValueError("no\nmore"), None)) == (
        "compiling the decoding graphs failed: ValueError: no")


def test_a_compile_failure_names_its_own_cause_not_a_damaged_cache(tmp_path):
    """Only a failure that looks like a damaged cache names the cache to remove: a C++ compile
    that failed gives the compiler's or linker's first error line (not torch's "C++ compile
    error"), and where torch's command split a path with spaces (inductor passes library
    directories unquoted: a venv at "sp ace venv"), that torch cannot compile from such a
    path; an OSError about the cache directory names it, its path and the reason, with
    TORCHINDUCTOR_CACHE_DIR to point elsewhere; any other error torch's reason alone.
    Exceptions as torch builds and raises them (``InductorError`` around the backend's)."""
    import errno
    import os
    import shlex

    from torch._inductor.exc import CppCompileError, InductorError

    from dflash_torch.decoding import compile_failure, inductor_cache

    failed, no_compile = "compiling the decoding graphs failed: ", "run without compiling (no --compile; bench: its modes"
    venv_lib = tmp_path / "sp ace venv" / "lib" / "python3.11" / "site-packages" / "torch" / "lib"
    venv_lib.mkdir(parents=True)
    build = f"g++ /c/ab/cab.main.cpp -shared -fPIC -O3 -I{shlex.quote(str(venv_lib.parent / 'include'))} " \
            f"-L{venv_lib} -L/usr/lib64 -ltorch -ltorch_cpu -lc10 -o /c/ab/cab.main.so"
    ld = ("/usr/bin/ld: cannot find ace: No such file or directory\n"
          "/usr/bin/ld: cannot find venv/lib/python3.11/site-packages/torch/lib: No such file or directory\n"
          "/usr/bin/ld: cannot find -ltorch: No such file or directory\n"
          "collect2: error: ld returned 1 exit status\n")
    spaced = InductorError(CppCompileError(shlex.split(build), ld), None)
    message = compile_failure(spaced)
    assert message == (f"{failed}CppCompileError: /usr/bin/ld: cannot find ace: No such file or directory; torch's C++ "
                       f"compile cannot handle a path with spaces ({str(venv_lib)!r}, which it split in its compiler "
                       f"command): {no_compile} without -compiled), or from a Python environment whose path has none")
    assert "damaged" not in message

    # the same linker failure where no path was split: the linker's line, no cache to remove
    plain = InductorError(CppCompileError(["g++", "/c/ab/cab.main.cpp", "-L/usr/lib64", "-ltorch"],
                                          "/usr/bin/ld: cannot find -ltorch: No such file or directory\n"
                                          "collect2: error: ld returned 1 exit status\n"), None)
    assert compile_failure(plain) == (f"{failed}CppCompileError: /usr/bin/ld: cannot find -ltorch: No such file or "
                                      f"directory; or {no_compile} without -compiled)")
    cxx = ("In file included from /c/ab/cab.main.cpp:2:\n/c/ab/cab.main.cpp: In function 'void kernel(float*)':\n"
           "/c/ab/cab.main.cpp:7:9: warning: unused variable 'y' [-Wunused-variable]\n"
           "/c/ab/cab.main.cpp:9:5: error: 'tmp0' was not declared in this scope\n"
           "/c/ab/cab.main.cpp:10:5: error: expected ';' before '}' token\n")
    assert compile_failure(InductorError(CppCompileError(["g++", "/c/ab/cab.main.cpp"], cxx), None)) == (
        f"{failed}CppCompileError: /c/ab/cab.main.cpp:9:5: error: 'tmp0' was not declared in this scope; "
        f"or {no_compile} without -compiled)")
    # a linker that finds a truncated object file in the cache: that is a damaged cache
    truncated = "/usr/bin/ld: /c/ab/cab.main.o: file not recognized: file truncated\ncollect2: error: ld returned 1\n"
    assert "; a damaged compile cache can cause this: remove " in compile_failure(
        InductorError(CppCompileError(["g++", "/c/ab/cab.main.o"], truncated), None))

    # the cache directory read-only, or another failure to write in it: the path and the reason,
    # and the variable to point elsewhere (not a directory to remove: it may be any, $HOME say)
    cache = inductor_cache()
    read_only = os.path.join(cache, "73")
    rofs = InductorError(OSError(errno.EROFS, os.strerror(errno.EROFS), read_only), None)
    assert compile_failure(rofs) == (
        f"{failed}OSError: [Errno 30] Read-only file system: '{read_only}'; torch inductor's cache directory "
        f"(TORCHINDUCTOR_CACHE_DIR={cache}) must be one this process can create and write: set TORCHINDUCTOR_CACHE_DIR "
        f"to another, or {no_compile} without -compiled)")
    full = InductorError(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(cache, "fxgraph", "x")), None)
    assert "No space left on device" in compile_failure(full) and "remove" not in compile_failure(full)
    elsewhere = InductorError(OSError(errno.EACCES, os.strerror(errno.EACCES), "/opt/data/x"), None)
    assert compile_failure(elsewhere) == (
        f"{failed}PermissionError: [Errno 13] Permission denied: '/opt/data/x'; or {no_compile} without -compiled)")
    assert compile_failure(InductorError(RuntimeError("lowering failed\nat node"), None)) == (
        f"{failed}RuntimeError: lowering failed; or {no_compile} without -compiled)")


def test_a_compile_that_fails_on_its_cache_directory_names_it(tmp_path, monkeypatch):
    """A real inductor compile that fails on its cache directory (``TORCHINDUCTOR_CACHE_DIR``
    under a file: torch's ``makedirs`` fails, before any C++ compile, in a fraction of a
    second) is a CompileError naming the directory and the variable, not a directory to
    remove."""
    import pytest

    from dflash_torch import CompileError
    from dflash_torch.decoding import compile_step

    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))

    def double(x):
        return x * 2 + 1

    step = compile_step(double)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(bad))  # (made unusable after torch.compile accepted it)
    with pytest.raises(CompileError) as info:
        step(torch.ones(3))
    assert str(info.value) == (
        f"compiling the decoding graphs failed: NotADirectoryError: [Errno 20] Not a directory: '{bad}'; torch "
        f"inductor's cache directory (TORCHINDUCTOR_CACHE_DIR={bad}) must be one this process can create and write: "
        "set TORCHINDUCTOR_CACHE_DIR to another, or run without compiling (no --compile; bench: its modes without "
        "-compiled)")


def test_a_compile_cache_directory_torch_cannot_create_is_one_line(tiny_pair, tmp_path, monkeypatch):
    """``TORCHINDUCTOR_CACHE_DIR`` that torch cannot create (here under a file; read-only in
    the field) fails torch.compile before any graph is built: where ``torch._dynamo`` is first
    imported (a command's first compile) and at every ``torch.compile`` call. Each is one line
    naming the variable, the path and the reason (a CompileError, exit status 1), not torch's
    traceback: in the Python API (an engine built with compile=True, this process having
    imported ``torch._dynamo`` already) and on the command line (a fresh process)."""
    import os
    import subprocess
    import sys

    import pytest

    from dflash_torch import CompileError, DFlashEngine

    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "inductor"
    expected = (f"compiling the decoding graphs failed: NotADirectoryError: [Errno 20] Not a directory: '{bad}'; torch "
                f"inductor's cache directory (TORCHINDUCTOR_CACHE_DIR={bad}) must be one this process can create and "
                "write: set TORCHINDUCTOR_CACHE_DIR to another, or run without compiling (no --compile; bench: its "
                "modes without -compiled)")
    target, drafter = _load(tiny_pair)
    spec = DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(bad))
    with pytest.raises(CompileError) as info:  # (the engine's decoder calls torch.compile when it is made)
        DFlashEngine(target, spec.tokenizer, drafter, max_context=64, compile=True)
    assert str(info.value) == expected and isinstance(info.value.__cause__, NotADirectoryError)

    # (set empty: torch's cache in the current directory, whose z3 folder a later compile imported, trial-303)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    with pytest.raises(CompileError, match=r"^TORCHINDUCTOR_CACHE_DIR is set but empty, which torch takes for the "
                                           r"current directory"):
        DFlashEngine(target, spec.tokenizer, drafter, max_context=64, compile=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(bad))

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(bad), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dflash_torch", "generate", "x", "--compile", "--max-context", "64",
                           "--max-new-tokens", "2", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1])],
                          capture_output=True, text=True, timeout=240, env=env)
    assert (proc.returncode, proc.stderr) == (1, f"dflash-torch: error: {expected}\n")


def test_a_graph_torch_fails_to_build_is_a_compile_error_and_a_500(tiny_pair):
    """The same failure in the Python API is a CompileError (a DFlashError; torch's error its
    cause), and in a server a 500 naming it, after which the server answers the next request.
    The backend compiler fails here by itself: torch wraps its error as it wraps inductor's
    (``BackendCompilerFailed``), for a fraction of an inductor compile's time."""
    import pytest
    from starlette.testclient import TestClient
    from torch._dynamo.exc import BackendCompilerFailed

    from dflash_torch import CompileError, DFlashEngine, DFlashError
    from dflash_torch.serving.app import create_app

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no compiler here\nsecond line")

    target, drafter = _load(tiny_pair)
    spec = DFlashEngine.from_pretrained(tiny_pair[0], no_draft=True)
    torch._dynamo.reset()
    engine = DFlashEngine(target, spec.tokenizer, drafter, max_context=64, compile=True, compile_backend=failing_backend)
    message = "compiling the decoding graphs failed: RuntimeError: no compiler here"
    for call in (engine.warmup, lambda: engine.generate("x", max_new_tokens=2)):
        with pytest.raises(CompileError) as info:
            call()
        assert str(info.value) == message
        assert isinstance(info.value, DFlashError) and isinstance(info.value.__cause__, BackendCompilerFailed)
    app = create_app(engine, max_batch_size=1)
    try:
        client = TestClient(app, raise_server_exceptions=False)
        for _ in range(2):  # (the server goes on)
            r = client.post("/v1/completions", json={"model": engine.name, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
            assert r.json()["error"]["message"].startswith(f"generation failed: {message} (request cmpl-"), r.text
    finally:
        app.state.scheduler.close()
    torch._dynamo.reset()
