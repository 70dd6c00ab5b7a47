"""Memory checks before loading: what a container's memory cgroup allows (psutil sees only
the host), and the prepacked copy of the linear weights on CPU bfloat16 (skipped with a
warning when it would not fit)."""

import logging

import pytest
import torch

import dflash_torch.checkpoint as checkpoint
import dflash_torch.engine as engine_module
from dflash_torch import DFlashEngine, DFlashError
from dflash_torch.checkpoint import cgroup_available
from dflash_torch.models.packing import PackedLinear, packed_bytes, packing_supported
from dflash_torch.models.target import TargetModel

GB = 1 << 30
HUGE = 2**40  # (a context whose caches fit no machine: nothing is allocated for it until a request grows them)


@pytest.fixture(scope="module")
def huge_context_target(tiny_pair, tmp_path_factory):
    """The tiny pair's target with a context of ``HUGE`` tokens (its ``max_position_embeddings``,
    as a long-context model's), whose caches for the whole context cannot fit in memory."""
    from conftest import edited_checkpoint

    return edited_checkpoint(tiny_pair[0], tmp_path_factory.mktemp("huge") / "target",
                             config=lambda cfg: cfg.update(max_position_embeddings=HUGE))


def _write(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cgroup_v2_limit_minus_usage_plus_reclaimable_cache_least_over_the_levels(tmp_path):
    root = tmp_path / "cgroup"
    _write(root, {
        "cgroup.controllers": "cpu memory\n",
        "memory.max": "max\n",  # the namespace root: no limit
        "memory.current": str(20 * GB),
        "job/memory.max": str(8 * GB),  # a container limit
        "job/memory.current": str(6 * GB),
        "job/memory.stat": f"anon {5 * GB}\nfile {GB}\ninactive_file {GB // 2}\nactive_file {GB // 2}\n",
        "job/step/memory.max": "max\n",
        "job/step/memory.current": str(6 * GB),
    })
    (tmp_path / "self").write_text("0::/job/step\n")
    assert cgroup_available(root, tmp_path / "self") == 8 * GB - 6 * GB + GB // 2
    _write(root, {"job/step/memory.max": str(7 * GB)})  # a tighter limit below: the least wins
    assert cgroup_available(root, tmp_path / "self") == GB
    _write(root, {"job/step/memory.current": str(9 * GB)})  # over the limit: nothing left, not negative
    assert cgroup_available(root, tmp_path / "self") == 0


def test_cgroup_v1_memory_controller_and_the_no_limit_number(tmp_path):
    root = tmp_path / "cgroup"
    _write(root, {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        "memory/memory.usage_in_bytes": str(3 * GB),
        "memory/memory.stat": "cache 100\ninactive_file 7\ntotal_inactive_file 300\n",
    })
    self_file = tmp_path / "self"
    self_file.write_text("5:devices:/\n4:memory:/docker/abc\n1:name=systemd:/\n0::/\n")
    assert cgroup_available(root, self_file) is None  # /docker/abc is not shown inside; the root has no limit
    _write(root, {"memory/memory.limit_in_bytes": str(4 * GB)})
    assert cgroup_available(root, self_file) == 4 * GB - 3 * GB + 300


def test_no_cgroup_mounted_means_no_limit(tmp_path):
    assert cgroup_available(tmp_path / "none", tmp_path / "none" / "cgroup") is None
    found = cgroup_available()  # this machine: no limit, or a number of bytes that is left
    assert found is None or found >= 0
    host = checkpoint.psutil.virtual_memory().available
    assert 0 < checkpoint.available_memory("cpu") <= host


def test_a_container_limit_below_the_host_memory_refuses_the_load(tiny_pair, monkeypatch):
    """psutil reports the host's memory; inside a container with a smaller limit the
    weights are refused by that limit (the process would be killed without a word)."""
    need = sum(p.numel() for p in TargetModel.from_pretrained(tiny_pair[0], torch.float32).parameters()) * 4
    monkeypatch.setattr(checkpoint, "cgroup_available", lambda: need - 1)
    with pytest.raises(checkpoint.DFlashError, match=r"^the target needs [0-9.]+ [kMG]B for its weights in float32; cpu has"):
        TargetModel.from_pretrained(tiny_pair[0], torch.float32)
    monkeypatch.setattr(checkpoint, "cgroup_available", lambda: need)
    assert TargetModel.from_pretrained(tiny_pair[0], torch.float32) is not None


def test_packed_bytes_counts_one_copy_per_linear_weight():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 6, bias=True), torch.nn.Linear(6, 10, bias=False))
    model[2].weight = torch.nn.Parameter(torch.zeros(10, 6, dtype=torch.bfloat16))
    assert packed_bytes(model) == 4 * 6 * 4 + 10 * 6 * 2  # weights only, in their own dtype; not the embedding


def _packed(engine) -> bool:
    return any(isinstance(m, PackedLinear) for m in engine.decoder.target.modules())


def test_prepacking_that_would_not_fit_is_skipped_with_a_warning(tiny_pair, monkeypatch, caplog):
    """The packed copies are a second copy of every linear weight: where they would not fit,
    the engine runs unpacked (slower) and says so, instead of running out of memory."""
    monkeypatch.setattr(engine_module, "packing_supported", lambda dtype, device: True)  # any CPU: only the decision runs
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 1)
    with caplog.at_level(logging.WARNING, logger="dflash_torch"):
        engine = DFlashEngine.from_pretrained(*tiny_pair, dtype="bfloat16")
    assert not _packed(engine)
    assert "not prepacking the linear weights for oneDNN: the packed copies need" in caplog.text
    assert len(engine.generate("def f(x):", max_new_tokens=4).token_ids) == 4


@pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU")
def test_prepacking_that_fits_packs_and_gives_the_same_tokens(tiny_pair, monkeypatch):
    tight = DFlashEngine.from_pretrained(*tiny_pair, dtype="bfloat16", pack=False)
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 1 << 50)
    roomy = DFlashEngine.from_pretrained(*tiny_pair, dtype="bfloat16")
    assert _packed(roomy) and not _packed(tight)
    assert tight.generate("def f(x):", max_new_tokens=12).token_ids == roomy.generate("def f(x):", max_new_tokens=12).token_ids


def test_fixed_shape_caches_that_do_not_fit_are_refused_before_allocating(tiny_pair, monkeypatch):
    """A fixed-shape decoder allocates its caches for max_context at once: when they would
    take more than 90% of the free memory it is refused in one line naming max_context (it
    went on to allocate them: an out-of-memory traceback, or a swapping machine); when they
    fit, what it allocates is exactly the estimate."""
    import dflash_torch.decoding as decoding
    from dflash_torch import DFlashError
    from dflash_torch.cache import FIT_MARGIN, cache_bytes
    from dflash_torch.decoding import SpeculativeDecoder
    from dflash_torch.models.drafter import DFlashDrafter

    target_dir, drafter_dir = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    rows = max(drafter.config.block_size, 32)
    need = cache_bytes(target, drafter, 1, -(-(1000 + rows + 1) // 256) * 256, rows, False, rows)
    monkeypatch.setattr(decoding, "available_memory", lambda device: need / 0.9 - 1)
    with pytest.raises(DFlashError, match=r"^the caches of max_context 1000 \(fixed shapes: allocated at once\) need "
                                          r"[0-9.]+ [KMG]iB but cpu has [0-9.]+ [KMG]iB free; lower it \(at most "
                                          r"(\d+) fits in 90% of that\)$") as err:
        SpeculativeDecoder(target, drafter, static=True, max_context=1000, prefill_chunk=32)
    assert err.value.name == "max_context"
    most = int(err.value.args[0].rsplit("at most ", 1)[1].split()[0])  # (it fits; one more does not, at the margin)
    SpeculativeDecoder(target, drafter, static=True, max_context=most, prefill_chunk=32)
    monkeypatch.setattr(decoding, "available_memory", lambda device: (need / 0.9 - 1) * FIT_MARGIN)
    SpeculativeDecoder(target, drafter, static=True, max_context=most, prefill_chunk=32)
    with pytest.raises(DFlashError, match=r"; lower it \(at most \d+ fits in 90% of that\)$"):
        SpeculativeDecoder(target, drafter, static=True, max_context=most + 1, prefill_chunk=32)
    # (batched: the largest max_context whose caches fit the slots, trial-234)
    import dflash_torch.batch as batch
    from dflash_torch.batch import BatchDecoder

    monkeypatch.setattr(batch, "available_memory", lambda device: need / 0.9 - 1)
    with pytest.raises(DFlashError, match=r"; lower either \(at most (\d+) tokens of context fit these slots in 90% of "
                                          r"that\)$") as err:
        BatchDecoder(target, drafter, max_batch_size=3, max_context=1000)
    most = int(err.value.args[0].rsplit("at most ", 1)[1].split()[0])
    BatchDecoder(target, drafter, max_batch_size=3, max_context=most)
    monkeypatch.setattr(batch, "available_memory", lambda device: (need / 0.9 - 1) * FIT_MARGIN)
    BatchDecoder(target, drafter, max_batch_size=3, max_context=most)
    with pytest.raises(DFlashError, match=r"\(at most \d+ tokens of context fit these slots in 90% of that\)$"):
        BatchDecoder(target, drafter, max_batch_size=3, max_context=most + 1)
    monkeypatch.setattr(decoding, "available_memory", lambda device: need / 0.9 + 1)
    decoder = SpeculativeDecoder(target, drafter, static=True, max_context=1000, prefill_chunk=32)
    caches = decoder.target_cache.kv.k + decoder.target_cache.kv.v + decoder.context.cache.k + decoder.context.cache.v
    assert sum(t.numel() * t.element_size() for t in caches) == need


def test_growing_caches_that_do_not_fit_a_request_are_refused_before_its_work(tiny_pair, monkeypatch):
    """One sequence at a time without fixed shapes, the caches grow to each request's prompt +
    max_new_tokens: where those would take more than 90% of the free memory the request is
    refused in one line naming max_new_tokens and the most new tokens that fit (it allocated
    them: torch's out-of-memory traceback, or a process killed; trial-234), which then run."""
    import dflash_torch.decoding as decoding
    from dflash_torch import DFlashError
    from dflash_torch.cache import FIT_MARGIN, cache_bytes

    engine = DFlashEngine.from_pretrained(*tiny_pair)
    prompt = engine.encode_prompt("def f(x):")
    decoder = engine.decoder
    need = cache_bytes(decoder.target, decoder.drafter, 1, 512, decoder.max_rows, False, decoder.max_rows)
    monkeypatch.setattr(decoding, "available_memory", lambda device: need / 0.9 / FIT_MARGIN + 1)  # (512 positions fit)
    most = 512 - len(prompt) - engine.block_size - 1
    with pytest.raises(DFlashError, match=rf"^the caches of the prompt \({len(prompt)} tokens\) \+ max_new_tokens "
                                          rf"\(900\) need [0-9.]+ [KMG]iB but cpu has [0-9.]+ [KMG]iB free; ask for at "
                                          rf"most {most} new tokens \(their caches fit in 90% of that\)$") as err:
        engine.generate(prompt, max_new_tokens=900)
    assert err.value.name == "max_new_tokens"
    with pytest.raises(DFlashError, match=rf"ask for at most {most} new tokens \(their caches fit in 90% of that\)$"):
        engine.generate(prompt, max_new_tokens=most + 1)
    assert len(engine.generate(prompt, max_new_tokens=most, ignore_eos=True).token_ids) == most
    assert decoder.target_cache.capacity == 512
    # (a refused request leaves the last request's rows kept: the next that starts with them reuses them, trial-237)
    monkeypatch.setattr(decoding, "available_memory", lambda device: 1 << 10)
    with pytest.raises(DFlashError, match=r"; the caches of one new token do not fit in 90% of that: give a shorter "
                                          r"prompt$"):
        engine.generate(prompt + [5] * 600, max_new_tokens=4)
    assert engine.generate(prompt, max_new_tokens=4).stats.cached_prompt_tokens == len(prompt)


def test_max_new_tokens_past_the_context_names_the_lower_of_the_context_and_memory_limits(tiny_pair,
                                                                                        huge_context_target):
    """A max_new_tokens past the context is refused with advice that the next request can
    take: where the caches of fewer new tokens than the context leaves fit the free memory, the
    one message names that lower figure (it named the context's, which the memory check then
    refused with another: trial-282); where the context is the lower, its message is as before."""
    from dflash_torch.errors import ContextOptionError

    engine = DFlashEngine.from_pretrained(str(huge_context_target), str(tiny_pair[1]))
    prompt = engine.encode_prompt("def f(x):")
    left = HUGE - len(prompt)
    with pytest.raises(ContextOptionError, match=rf"^prompt \({len(prompt)} tokens\) \+ max_new_tokens \({10**15}\) "
                                                 rf"exceeds the context of {HUGE} tokens, and the caches of the {left} "
                                                 r"new tokens it leaves need [0-9.]+ TiB but cpu has [0-9.]+ [KMG]iB "
                                                 r"free; ask for at most (\d+) new tokens \(their caches fit in 90% of "
                                                 r"that\)$") as err:
        engine.generate(prompt, max_new_tokens=10**15)
    assert err.value.names == ("max_new_tokens",)
    most = int(err.value.args[0].rsplit("at most ", 1)[1].split()[0])
    assert 0 < most < left
    with pytest.raises(DFlashError, match=r"ask for at most \d+ new tokens \(their caches fit in 90% of that\)$"):
        engine.generate(prompt, max_new_tokens=left)  # (within the context: the memory's refusal, as before)
    assert engine.decoder.target_cache.capacity < 1024  # (nothing was allocated for them)
    small = DFlashEngine.from_pretrained(*tiny_pair)  # (a context of 1024 tokens: the context is the lower limit)
    with pytest.raises(ContextOptionError, match=rf"^prompt \({len(prompt)} tokens\) \+ max_new_tokens \({10**15}\) "
                                                 rf"exceeds the context of 1024 tokens; ask for at most "
                                                 rf"{1024 - len(prompt)} new tokens$"):
        small.generate(prompt, max_new_tokens=10**15)


def test_caches_of_the_default_context_that_do_not_fit_name_the_targets_context(tiny_pair, monkeypatch, cli):
    """Without max_context the caches are sized by the target's context: a refusal says so
    (it said "the caches of --max-context 100000000 ...; lower it" of a flag never given,
    trial-185), for SpeculativeDecoder, BatchDecoder and the command line; a max_context
    given is named as before."""
    import dflash_torch.batch as batch
    import dflash_torch.decoding as decoding
    from dflash_torch import DFlashError
    from dflash_torch.batch import BatchDecoder
    from dflash_torch.decoding import SpeculativeDecoder
    from dflash_torch.models.drafter import DFlashDrafter

    target_dir, drafter_dir = tiny_pair
    target = TargetModel.from_pretrained(target_dir, torch.float32)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32)
    for module in (decoding, batch):
        monkeypatch.setattr(module, "available_memory", lambda device: 1 << 10)
    with pytest.raises(DFlashError, match=r"^the caches of the target's context, 1024 tokens \(the default max_context; "
                                          r"fixed shapes: allocated at once\) need [0-9.]+ [KMG]iB but cpu has 1.0 KiB "
                                          r"free; give a lower one$") as err:
        SpeculativeDecoder(target, drafter, static=True)
    assert err.value.name == "max_context"
    with pytest.raises(DFlashError, match=r"^the caches of max_batch_size 2 x the target's context, 1024 tokens \(the "
                                          r"default max_context\) need [0-9.]+ [KMG]iB but cpu has 1.0 KiB free; lower "
                                          r"either$"):
        BatchDecoder(target, drafter, max_batch_size=2)
    with pytest.raises(DFlashError, match=r"^the caches of max_batch_size 2 x max_context 64 need "):
        BatchDecoder(target, drafter, max_batch_size=2, max_context=64)
    base = ("generate", "def f(x):", "--target", str(target_dir), "--draft", str(drafter_dir), "--compile")
    proc = cli(*base)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "dflash-torch: error: the caches of the target's context, 1024 tokens (the default --max-context; fixed "
        "shapes: allocated at once) need "), proc.stderr
    assert proc.stderr.endswith("1.0 KiB free; give a lower one\n") and "max_context" not in proc.stderr, proc.stderr
    proc = cli(*base, "--max-context", "512")
    assert proc.returncode == 2 and "error: the caches of --max-context 512 (fixed shapes: allocated at once) need " \
        in proc.stderr and proc.stderr.endswith("1.0 KiB free; lower it\n"), proc.stderr


def test_a_server_of_one_slot_refuses_at_start_a_context_whose_caches_do_not_fit(tiny_pair, huge_context_target, cli):
    """One sequence at a time (``--max-batch-size 1``, ``--draft-mode recompute``) the caches
    grow to each request's prompt + max_tokens, and a request that leaves out max_tokens asks
    for the rest of the context: a context whose caches for one sequence cannot fit is refused
    when the server starts, naming the context and the most that fits, as the batched server's
    slots are (it served, and refused every such request for memory, blaming a max_tokens the
    client never sent: trial-282). A one-shot generate is not refused (its requests ask for
    less)."""
    import socket

    from dflash_torch.serving.app import create_app

    target_dir, drafter_dir = huge_context_target, tiny_pair[1]
    engine = DFlashEngine.from_pretrained(str(target_dir), str(drafter_dir), max_batch_size=1)
    with pytest.raises(DFlashError, match=rf"^the caches of the target's context, {HUGE} tokens \(the default "
                                          r"max_context; one sequence, as a request may grow them\) need [0-9.]+ TiB "
                                          r"but cpu has [0-9.]+ [KMG]iB free; give a lower one \(at most (\d+) fits "
                                          r"in 90% of that\)$") as err:
        create_app(engine, max_batch_size=1)
    assert err.value.names == ("max_context",)
    most = int(err.value.args[0].rsplit("at most ", 1)[1].split()[0])
    assert len(engine.generate("def f(x):", max_new_tokens=4).token_ids) == 4
    recompute = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, draft_mode="recompute")
    with pytest.raises(DFlashError, match=rf"^the caches of the target's context, {HUGE} tokens .*; give a lower one"):
        create_app(recompute)
    lower = DFlashEngine(engine.target, engine.tokenizer, engine.drafter, max_batch_size=1, max_context=most // 4)
    create_app(lower, max_batch_size=1).state.scheduler.close()  # (a context that fits serves)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = ("serve", "--target", str(target_dir), "--draft", str(drafter_dir), "--port", str(port))
    proc = cli(*serve, "--max-batch-size", "1", "--max-context", str(10**12))
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"dflash-torch: error: the caches of --max-context {10**12} (one sequence, as a request may grow them) need "), \
        proc.stderr
    assert proc.stderr.endswith(" fits in 90% of that)\n") and "; lower it (at most " in proc.stderr, proc.stderr
    assert "max_context" not in proc.stderr and "serving" not in proc.stdout and proc.stderr.count("\n") == 1


def test_under_an_address_space_limit_the_largest_weight_file_counts_on_top_of_the_weights(tiny_pair, monkeypatch):
    """safetensors maps a weight file whole while it is read, so under ``ulimit -v`` weights
    that fit the limit failed to load ("unable to mmap N bytes"): the check counts the largest
    weight file on top of weights loaded on the CPU (alone for another device), those counted
    at least at the files' size (a float32 checkpoint read into bfloat16 needed what it needs
    in float32: trial-248), in one line naming the figures (trial-238, noticed). A real limit
    on a meta model, then a real checkpoint."""
    resource = pytest.importorskip("resource")
    import psutil

    from dflash_torch.checkpoint import check_fits, weight_file_sizes, weight_files
    from dflash_torch.errors import DFlashError

    target = tiny_pair[0]
    assert weight_file_sizes(target) == [f.stat().st_size for f in weight_files(target)] and weight_file_sizes(target)[0]
    with torch.device("meta"):
        model = torch.nn.Linear(8192, 8192, bias=False)  # (256 MiB in float32, 128 MiB in bfloat16)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = psutil.Process().memory_info().vms + (400 << 20)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("the hard limit is below the test's")
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        check_fits(model, torch.float32, "cpu", "target")  # (the weights alone fit)
        check_fits(model, torch.bfloat16, "cpu", "target", files=[128 << 20])  # (stored in bfloat16)
        check_fits(model, torch.float32, "cpu", "target", files=[128 << 20] * 2)  # (two shards: one mapped at a time)
        check_fits(model, torch.float32, "meta", "target", files=[256 << 20])  # (another device: the map alone)
        for dtype in (torch.float32, torch.bfloat16):  # (stored in float32: read in bfloat16 too)
            weights = {torch.float32: "268.4 MB", torch.bfloat16: "134.2 MB"}[dtype]
            with pytest.raises(DFlashError, match=rf"^the target needs {weights} for its weights in {str(dtype)[6:]} "
                                                  r"\(268\.4 MB of weight files\) and 268\.4 MB more to map its largest "
                                                  r"weight file while it is read; the address-space limit \(ulimit -v\) "
                                                  r"leaves [0-9.]+ MB$"):
                check_fits(model, dtype, "cpu", "target", files=[256 << 20])
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    # (loading passes the files' sizes: a limit that leaves the weights and not the map refuses the checkpoint)
    engine = DFlashEngine.from_pretrained(str(target), no_draft=True)
    need = checkpoint.weight_bytes(engine.target, next(engine.target.parameters()).dtype)
    sizes = weight_file_sizes(target)
    monkeypatch.setattr(checkpoint, "address_space_left", lambda: max(need, sum(sizes)) + max(sizes) - 1)
    with pytest.raises(DFlashError, match=r"^the target needs .* more to map its largest weight file while it is read"):
        DFlashEngine.from_pretrained(str(target), no_draft=True)
    monkeypatch.setattr(checkpoint, "address_space_left", lambda: max(need, sum(sizes)) + max(sizes))
    assert DFlashEngine.from_pretrained(str(target), no_draft=True).generate("x", max_new_tokens=2).token_ids


def test_an_address_space_limit_counts_as_less_free_memory():
    """Under ``ulimit -v`` (a soft RLIMIT_AS) a CPU tensor past the limit fails to allocate
    (torch's "DefaultCPUAllocator: can't allocate memory" traceback) however much memory is
    free: the free memory the checks see is at most what the limit leaves (trial-237)."""
    resource = pytest.importorskip("resource")
    import psutil

    from dflash_torch.checkpoint import address_space_left, available_memory

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = psutil.Process().memory_info().vms + (1 << 30)
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("the hard limit is below the test's")
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        left, free = address_space_left(), available_memory("cpu")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert 0 < left <= 1 << 30 and free <= left
    assert (address_space_left() is None) == (soft == resource.RLIM_INFINITY)
