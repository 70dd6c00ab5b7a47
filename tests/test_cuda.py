"""GPU decoding (issue 12): what CUDA graphs and eager CUDA need from the decoder.

The CPU-side tests run everywhere: every buffer a compiled step writes in place is a
static address for torch.compile (else inductor skips CUDA graphs: "mutated inputs"),
the verify rows that a CUDA-graphed loop carries into the next propose are copies, not
graph outputs, and eager CUDA steps run SDPA without cuDNN attention (which builds a
plan per new shape). The tests marked ``cuda`` need a GPU and are skipped without one
(``scripts/gpu_check.sh`` runs them there).
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils

from conftest import run_rounds, varied_prompts

from dflash_torch import SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cache import KVCache, static_buffer
from dflash_torch.decoding import SpeculativeDecoder, compile_counts, without_shape_plans
from dflash_torch.models.drafter import DFlashDrafter
from dflash_torch.models.target import TargetModel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")


def _load(pair, device="cpu", dtype=torch.float32):
    target_dir, drafter_dir = pair
    return TargetModel.from_pretrained(target_dir, dtype, device), DFlashDrafter.from_pretrained(drafter_dir, dtype, device)


def _static(t: torch.Tensor) -> bool:
    return getattr(t, "_dynamo_static_input_type", None) is not None


def test_cache_buffers_are_static_addresses(agree_hybrid_pair):
    target, drafter = _load(agree_hybrid_pair)
    decoder = SpeculativeDecoder(target, drafter, static=True, max_context=128)
    kv, recurrent = decoder.target_cache.kv, decoder.target_cache.recurrent
    buffers = kv.k + kv.v + recurrent.conv + recurrent.ssm + decoder.context.cache.k + decoder.context.cache.v
    assert len(buffers) > 4 and all(_static(t) for t in buffers)
    cache = KVCache(2, 2, 8, torch.float32, "cpu")
    cache.reset(300)  # grows: new buffers, marked too
    assert cache.capacity == 512 and all(_static(t) for t in cache.k + cache.v)
    marked, ours = torch.zeros(2), static_buffer(torch.zeros(2))  # (ours sets what torch's own call sets)
    torch._dynamo.mark_static_address(marked)
    assert ours.__dict__ == marked.__dict__ == {"_dynamo_static_input_type": "unguarded"}


@pytest.mark.parametrize("pair", ["agree_pair", "agree_hybrid_pair"])
def test_carried_verify_outputs_are_copies(pair, request):
    """With CUDA graphs, a verify's outputs live in the graph's pool until a later replay
    overwrites them: the feature rows the next propose injects, and a hybrid target's
    stash that the commit reads, must be copies. Forced on (``graphed``) in an eager
    fixed-shape loop, what the propose and the commit get is checked against the storage
    of the last verify's outputs (a graph returns the stash as outputs too); the output
    is unchanged."""
    target, drafter = _load(request.getfixturevalue(pair))
    prompt = varied_prompts(target, 1)[0]
    reference = run_rounds(SpeculativeDecoder(target, drafter), prompt, 40)[0]
    decoder = SpeculativeDecoder(target, drafter, static=True, max_context=128)
    decoder.graphed = True
    recurrent = decoder.target_cache.recurrent
    verify, draft, commit = decoder._verify_fn, decoder._draft_fn, decoder._commit_fn
    last_outputs, shared = [], []

    def ptrs(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors}

    def recorded_verify(*args):
        out = verify(*args)
        stash = [t for slot in range(len(recurrent.conv)) for t in recurrent.stashed(slot)] if recurrent else []
        last_outputs[:] = list(out) + stash  # kept alive: their storage cannot be reused meanwhile
        return out

    def recorded_draft(token, s, kv_len, features=None, feature_start=None):
        if last_outputs:
            shared.append(bool(ptrs([features]) & ptrs(last_outputs)))
        return draft(token, s, kv_len, features, feature_start)

    def recorded_commit(rows):
        stash = [t for slot in range(len(recurrent.conv)) for t in recurrent.stashed(slot)]
        shared.append(bool(ptrs(stash) & ptrs(last_outputs)))
        return commit(rows)

    decoder._verify_fn, decoder._draft_fn, decoder._commit_fn = recorded_verify, recorded_draft, recorded_commit
    assert run_rounds(decoder, prompt, 40)[0] == reference
    assert len(shared) > 3 and not any(shared)
    assert (recurrent is not None) == (pair == "agree_hybrid_pair") == decoder.defer_commit


def test_batch_recurrent_states_are_static_and_the_carried_stash_is_copied(agree_hybrid_pair):
    """Batched hybrid decoding: the slot states (and the per-slot views the layers write)
    are static addresses, and with CUDA graphs (``graphed``, forced on in an eager
    fixed-shape batch) each sequence's commit reads a copy of its stash, not the verify's
    outputs; every output is unchanged."""
    from test_batch import alone, drive

    target, drafter = _load(agree_hybrid_pair)
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=96, static=True)
    states = batch.target_state
    views = [t for i in range(2) for t in states.slot(i).conv + states.slot(i).ssm]
    assert len(views) > 4 and all(_static(t) for t in states.conv + states.ssm + views)
    batch.graphed = True
    verify, commit = batch._verify_fn, batch._commit
    last_outputs, shared = [], []

    def stash(n):  # the stash of a round of n sequences (batch bucket rows)
        return [t for layer in range(len(states.conv)) for t in states.first(batch.batch_bucket(n)).stashed(layer)]

    def ptrs(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors}

    def recorded_verify(block, positions, kv_len, cache, commit_rows, defer):
        out = verify(block, positions, kv_len, cache, commit_rows, defer)
        last_outputs[:] = list(out) + stash(positions.shape[0])  # kept alive: storage not reused meanwhile
        return out

    def recorded_commit(live, accepted):
        shared.append(bool(ptrs(stash(len(live))) & ptrs(last_outputs)))
        return commit(live, accepted)

    batch._verify_fn, batch._commit = recorded_verify, recorded_commit
    prompts = varied_prompts(target, 2)
    out = drive(batch, [(0, "add", i, p, SamplingParams(), 30) for i, p in enumerate(prompts)])
    assert [out[0], out[1]] == [alone(target, drafter, p, 30) for p in prompts]
    assert len(shared) > 3 and not any(shared)


def test_target_only_rounds_park_copies_of_the_verify_rows_under_cuda_graphs(agree_pair):
    """Rounds above ``draft_max_batch_size`` keep each sequence's verified feature rows for a
    later injection; with CUDA graphs (``graphed``, forced on in an eager fixed-shape
    batch) what is kept and injected are copies, never a verify's outputs (a later replay
    overwrites those); every output is unchanged."""
    from test_batch import alone, drive

    target, drafter = _load(agree_pair)
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=96, static=True, draft_max_batch_size=1)
    batch.graphed = True
    verify, flush = batch._verify_fn, batch._flush
    outputs, shared, flushed = [], [], []

    def ptrs(tensors):
        return {t.untyped_storage().data_ptr() for t in tensors}

    def recorded_verify(*args):
        out = verify(*args)
        outputs.extend(out)  # kept alive: their storage cannot be reused meanwhile
        return out

    def recorded_flush(q, slot):
        shared.append(bool(ptrs(q.backlog) & ptrs(outputs)))
        flushed.append(len(q.backlog))
        return flush(q, slot)

    batch._verify_fn, batch._flush = recorded_verify, recorded_flush
    prompts = varied_prompts(target, 2)
    out = drive(batch, [(0, "add", 0, prompts[0], SamplingParams(), 30), (3, "add", 1, prompts[1], SamplingParams(), 8)])
    assert [out[0], out[1]] == [alone(target, drafter, p, n) for p, n in zip(prompts, (30, 8))]
    assert max(flushed) > 3 and not any(shared)


def test_eager_cuda_sdpa_leaves_out_cudnn():
    backends = without_shape_plans(lambda: (torch.backends.cuda.cudnn_sdp_enabled(),
                                            torch.backends.cuda.flash_sdp_enabled(),
                                            torch.backends.cuda.mem_efficient_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert backends() == (False, True, True)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored


# --- on a GPU ---------------------------------------------------------------------------


def _modes(target, drafter):
    return {
        "target-only": SpeculativeDecoder(target, None),
        "inject": SpeculativeDecoder(target, drafter),
        "inject-static": SpeculativeDecoder(target, drafter, static=True, max_context=512),
        "target-only-compiled": SpeculativeDecoder(target, None, compile=True, max_context=512),
        "inject-compiled": SpeculativeDecoder(target, drafter, compile=True, max_context=512),
    }


@cuda
@pytest.mark.parametrize("pair", ["agree_pair", "agree_hybrid_pair", "agree_dflash2_pair", "agree_speculators_pair"])
def test_cuda_modes_equal_target_only_with_cuda_graphs(pair, request):
    """float32 on CUDA: every mode commits exactly the target-only tokens; compiled modes
    run every graph as a CUDA graph (none skipped) and recompile nothing after warm-up."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target, drafter = _load(request.getfixturevalue(pair), "cuda")
    prompts = varied_prompts(target, 3)
    modes = _modes(target, drafter)
    for name, decoder in modes.items():  # warm-up: every length bucket the prompts reach
        run_rounds(decoder, prompts[0], 150)
    frames, skips = compile_counts()
    assert skips == 0, "a compiled graph ran without CUDA graphs"
    for prompt in prompts:
        reference = run_rounds(modes["target-only"], prompt, 120)[0]
        for name, decoder in modes.items():
            assert run_rounds(decoder, prompt, 120)[0] == reference, name
    assert compile_counts() == (frames, 0), "recompiled after warm-up, or skipped CUDA graphs"


@cuda
@pytest.mark.parametrize("pair", ["agree_pair", "agree_hybrid_pair"])
def test_prefix_reuse_one_at_a_time_on_cuda_graphs_equals_target_only(pair, request):
    """float32 on CUDA, compiled (CUDA graphs) with ``reuse_prefix``: a turn that extends the
    last one's rows, one that diverges inside the last reply (a hybrid: restored from the
    prompt-end copy), one inside the prompt, and the same prompt again commit the target-only
    tokens; no graph is skipped or recompiled after warm-up."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target, drafter = _load(request.getfixturevalue(pair), "cuda")
    alone = SpeculativeDecoder(target, None)
    decoder = SpeculativeDecoder(target, drafter, compile=True, max_context=512, prefill_chunk=32, reuse_prefix=True)
    decoder.warmup(512)
    frames, skips = compile_counts()
    assert skips == 0, "a compiled graph ran without CUDA graphs"
    p0 = varied_prompts(target, 1, seed=3, length=40)[0]
    first = run_rounds(decoder, p0, 30)[0]
    prompts = [p0 + first + [7, 8], None, p0[:9] + [7, 8]]
    prompts[1] = prompts[0] + run_rounds(decoder, prompts[0], 30)[0][:3] + [9]
    for prompt in prompts + [prompts[2]]:
        assert run_rounds(decoder, prompt, 60)[0] == run_rounds(alone, prompt, 60)[0]
    assert decoder.reused_prefill_tokens > len(p0)
    assert compile_counts() == (frames, 0), "recompiled after warm-up, or skipped CUDA graphs"


def _gpt_oss_modes_equal_target_only(pair, device: str, mxfp4: str) -> None:
    """:func:`_modes_and_batch_equal_target_only` for a gpt-oss target (experts dequantized
    or kept MXFP4) on ``device``."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target_dir, drafter_dir = pair
    target = TargetModel.from_pretrained(target_dir, torch.float32, device, mxfp4=mxfp4)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, torch.float32, device)
    assert target.model.layers[0].mlp.experts.packed == (mxfp4 == "packed")
    _modes_and_batch_equal_target_only(target, drafter, device)


def _modes_and_batch_equal_target_only(target, drafter, device: str) -> None:
    """Every mode of :func:`_modes` and a compiled batch commit the target-only tokens on
    ``device``; compiled graphs all run as CUDA graphs there and nothing recompiles after
    warm-up (call with the compiler's counters reset)."""
    from dflash_torch.batch import BatchDecoder
    from test_batch import alone, drive, join_leave_plan

    prompts = varied_prompts(target, 3)
    modes = _modes(target, drafter)
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=100, prefill_chunk=32, compile=True)
    for decoder in modes.values():  # warm-up: every length bucket the prompts reach
        run_rounds(decoder, prompts[0], 150)
    batch.warmup()
    frames, skips = compile_counts()
    if device.startswith("cuda"):
        assert skips == 0, "a compiled graph ran without CUDA graphs"
    for prompt in prompts:
        reference = run_rounds(modes["target-only"], prompt, 120)[0]
        for name, decoder in modes.items():
            assert run_rounds(decoder, prompt, 120)[0] == reference, name
    joining = varied_prompts(target, 4)
    plan, budgets, params = join_leave_plan(joining)
    out = drive(batch, plan)
    for sid in (1, 2, 3):
        assert out[sid] == alone(target, drafter, joining[sid], budgets[sid], params[sid]), f"sequence {sid}"
    assert compile_counts() == (frames, 0), "recompiled after warm-up, or skipped CUDA graphs"


@cuda
@pytest.mark.parametrize("pair,mxfp4", [("agree_gpt_oss_pair", "auto"), ("mxfp4_gpt_oss_pair", "packed"),
                                        ("mxfp4_gpt_oss_pair", "dequantize")])
def test_gpt_oss_modes_and_batch_on_cuda_graphs_equal_target_only(pair, mxfp4, request):
    """gpt-oss on CUDA (sink attention, sliding window, biased experts; MXFP4 experts packed:
    the CUDA-graph path dequantizes a layer's experts inside the graph)."""
    _gpt_oss_modes_equal_target_only(request.getfixturevalue(pair), "cuda", mxfp4)


@cuda
def test_packed_fp8_hybrid_moe_modes_and_batch_on_cuda_graphs_equal_target_only(tmp_path, tokenizer_dir):
    """A Qwen3-Next (hybrid, MoE) FP8 target kept FP8 on CUDA: each forward dequantizes its
    linears and, inside the CUDA graphs, the chosen experts; every mode and a compiled batch
    commit the target-only tokens."""
    from conftest import make_agreeable_pair
    from test_fp8 import to_fp8

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target_dir, drafter_dir = make_agreeable_pair(tmp_path / "pair", tokenizer_dir, block_size=8,
                                                  model_type="qwen3_next", alpha=1.0, self_scale=0.0)
    keep = tuple(f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(6))
    quantized = to_fp8(target_dir, tmp_path / "fp8", (32, 48), keep, suffixes=("_proj.weight", "in_proj_qkvz.weight"))
    target = TargetModel.from_pretrained(quantized, torch.float32, "cuda", fp8="packed")
    assert target.config.keep_fp8
    _modes_and_batch_equal_target_only(target, DFlashDrafter.from_pretrained(drafter_dir, torch.float32, "cuda"), "cuda")


@cuda
def test_packed_w4a16_moe_modes_and_batch_on_cuda_graphs_equal_target_only(tmp_path, tokenizer_dir):
    """A Qwen3-MoE W4A16 target kept packed on CUDA (compressed-tensors' int4 words): each
    forward dequantizes its linears and, inside the CUDA graphs, the chosen experts; every
    mode and a compiled batch commit the target-only tokens."""
    pytest.importorskip("compressed_tensors")  # (test_packed_int's quantizer; not on every GPU machine)
    from conftest import make_agreeable_pair
    from test_packed_int import to_packed

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target_dir, drafter_dir = make_agreeable_pair(tmp_path / "pair", tokenizer_dir, block_size=8,
                                                  model_type="qwen3_moe", alpha=1.0, self_scale=0.0)
    quantized = to_packed(target_dir, tmp_path / "w4a16", 4, 32)
    target = TargetModel.from_pretrained(quantized, torch.float32, "cuda", int_weights="packed")
    assert target.config.keep_int
    _modes_and_batch_equal_target_only(target, DFlashDrafter.from_pretrained(drafter_dir, torch.float32, "cuda"), "cuda")


@cuda
def test_packed_nvfp4_moe_modes_and_batch_on_cuda_graphs_equal_target_only(tmp_path, tokenizer_dir):
    """A Qwen3-MoE ModelOpt NVFP4 target kept packed on CUDA (nvfp4="packed"): each forward
    dequantizes its linears and, inside the CUDA graphs, the chosen experts from tables (on the
    GPU) the loader's arithmetic fills; every mode and a compiled batch commit the target-only tokens."""
    pytest.importorskip("compressed_tensors")  # (test_nvfp4 imports it; not on every GPU machine)
    from conftest import make_agreeable_pair
    from test_nvfp4 import to_modelopt

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target_dir, drafter_dir = make_agreeable_pair(tmp_path / "pair", tokenizer_dir, block_size=8,
                                                  model_type="qwen3_moe", alpha=1.0, self_scale=0.0)
    quantized = to_modelopt(target_dir, tmp_path / "nvfp4")
    target = TargetModel.from_pretrained(quantized, torch.float32, "cuda", nvfp4="packed")
    assert target.config.keep_nvfp4
    _modes_and_batch_equal_target_only(target, DFlashDrafter.from_pretrained(drafter_dir, torch.float32, "cuda"), "cuda")


def _deepseek_v4_modes_equal_target_only(root, tokenizer_dir, device: str, packed: bool) -> None:
    """:func:`_modes_and_batch_equal_target_only` for an agreeable DeepSeek-V4 pair (test_deepseek_v4's
    recipe: hyper-connection streams, compressed entries and the indexer in the KV cache slots,
    a Speculators drafter reading the streams) on ``device``; ``packed``: the target in its
    published layout (test_deepseek_v4_quant's: FP8 linears with ue8m0 scales, FP4 experts),
    both kept packed."""
    from test_deepseek_v4 import make_v4_target, published_layout
    from test_deepseek_v4_quant import V4_FP4, V4_FP8, to_published_layout

    from conftest import make_agreeable, v4_drafter

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target = make_v4_target(root / "target", seed=1, moe_intermediate_size=32)
    target, _ = make_agreeable(target, tokenizer_dir, root, "deepseek_v4", block_size=8, alpha=1.0, self_scale=1.0)
    drafter_dir = v4_drafter(target, root / "spec", std=0.02)
    options = {}
    if packed:
        target = to_published_layout(published_layout(target, root / "top"), root / "published", (8, 8),
                                     V4_FP8.search, V4_FP4.search)
        options = dict(fp8="packed", mxfp4="packed")
    model = TargetModel.from_pretrained(target, torch.float32, device, **options)
    assert model.config.keep_fp8 == packed and model.config.keep_mxfp4 == packed
    _modes_and_batch_equal_target_only(model, DFlashDrafter.from_pretrained(drafter_dir, torch.float32, device), device)


@cuda
@pytest.mark.parametrize("packed", [False, True], ids=["unquantized", "published-packed"])
def test_deepseek_v4_modes_and_batch_on_cuda_graphs_equal_target_only(packed, tmp_path, tokenizer_dir):
    """DeepSeek-V4 on CUDA: every mode and a compiled batch commit the target-only tokens (the
    compressed-entry writes and the indexer's top-k inside CUDA graphs; packed: FP8 linears and
    FP4 experts dequantized inside them)."""
    _deepseek_v4_modes_equal_target_only(tmp_path, tokenizer_dir, "cuda", packed)


@cuda
def test_compiled_hybrid_batch_on_cuda_graphs_equals_alone(agree_hybrid_pair):
    """float32 on CUDA, a hybrid target: the compiled batch (inductor, CUDA graphs) with
    sequences joining and leaving gives each sequence's tokens decoded alone, runs every
    graph as a CUDA graph and recompiles nothing after warm-up."""
    from test_batch import alone, drive, join_leave_plan

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target, drafter = _load(agree_hybrid_pair, "cuda")
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=100, prefill_chunk=32, compile=True)
    batch.warmup()
    frames, skips = compile_counts()
    assert skips == 0, "a compiled graph ran without CUDA graphs"
    prompts = varied_prompts(target, 4)
    plan, budgets, params = join_leave_plan(prompts)
    out = drive(batch, plan)
    for sid in (1, 2, 3):
        assert out[sid] == alone(target, drafter, prompts[sid], budgets[sid], params[sid]), f"sequence {sid}"
    assert compile_counts() == (frames, 0), "recompiled after warm-up, or skipped CUDA graphs"


@cuda
def test_compiled_hybrid_batch_on_cuda_graphs_with_target_only_rounds_equals_the_target(agree_hybrid_pair):
    """float32 on CUDA, a hybrid target, ``draft_max_batch_size=1``: rounds switch between
    drafting (one sequence) and target-only (more), under CUDA graphs; every greedy
    sequence gets the target's own tokens, and nothing recompiles after warm-up."""
    from test_batch import alone, drive

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target, drafter = _load(agree_hybrid_pair, "cuda")
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=100, prefill_chunk=32, compile=True,
                         draft_max_batch_size=1)
    batch.warmup()
    frames, skips = compile_counts()
    assert skips == 0, "a compiled graph ran without CUDA graphs"
    prompts, budgets, greedy = varied_prompts(target, 3), [50, 12, 12], SamplingParams()
    plan = [(0, "add", 0, prompts[0], greedy, budgets[0]), (3, "add", 1, prompts[1], greedy, budgets[1]),
            (3, "add", 2, prompts[2], greedy, budgets[2])]
    out = drive(batch, plan)
    for sid in (0, 1, 2):
        assert out[sid] == alone(target, None, prompts[sid], budgets[sid]), f"sequence {sid}"
    assert compile_counts() == (frames, 0), "recompiled after warm-up, or skipped CUDA graphs"


def _auto_logprobs_penalty_run(pair, device: str, compile: bool):
    """Three sequences through a batch decoder whose ``"auto"`` policy switches kinds every
    other round: greedy with logprobs, greedy with a presence penalty, plain greedy ->
    ``{seq_id: (tokens, logprobs)}`` and the decoder."""
    from dflash_torch.draft_policy import DraftPolicy

    target, drafter = _load(pair, device)
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=100, prefill_chunk=32, compile=compile,
                         static=not compile, draft_max_batch_size="auto")
    if compile:
        batch.warmup()
    batch.policy = DraftPolicy(explore_every=2, probe_rounds=2)
    params = {0: SamplingParams(logprobs=2), 1: SamplingParams(presence_penalty=1.0), 2: SamplingParams()}
    prompts = varied_prompts(target, 3)
    out = {sid: ([], []) for sid in params}
    for sid, p in params.items():
        rnd = batch.add(sid, prompts[sid], p, 30)
        out[sid][0].extend(rnd.tokens)
        out[sid][1].extend(rnd.logprobs or [])
    while batch.seq_ids:
        for sid, rnd in batch.step().items():
            out[sid][0].extend(rnd.tokens)
            out[sid][1].extend(rnd.logprobs or [])
        for sid in batch.seq_ids:
            if len(out[sid][0]) >= 30:
                batch.remove(sid)
    return {sid: (t[:30], lp[:30]) for sid, (t, lp) in out.items()}, batch


@cuda
def test_auto_policy_with_logprobs_and_a_penalty_on_cuda_graphs_equals_cpu(agree_pair):
    """float32, CUDA graphs, the ``"auto"`` policy switching kinds, logprobs and a presence
    penalty: the tokens and logprobs of the eager CPU batch decoder (fixed shapes), both
    kinds of round ran, no CUDA graph skipped."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    want, _ = _auto_logprobs_penalty_run(agree_pair, "cpu", compile=False)
    got, batch = _auto_logprobs_penalty_run(agree_pair, "cuda", compile=True)
    assert compile_counts()[1] == 0 and batch.target_only_rounds > 0
    for sid in want:
        assert got[sid][0] == want[sid][0], f"sequence {sid}"
        for a, b in zip(got[sid][1], want[sid][1]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
    assert len(got[0][1]) == 30


def _structured_run(pair, device: str, compile: bool):
    """Constrained greedy decoding (regex, JSON schema) of the agreeable pair, alone and
    batched, float32, on ``device``."""
    from dflash_torch import DFlashEngine

    engine = DFlashEngine.from_pretrained(*pair, dtype="float32", device=device, compile=compile, max_context=256,
                                          max_batch_size=4)
    specs = [{"regex": "[A-Z ]{1,40}"}, {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                  "required": ["n"], "x-guidance": {"whitespace_flexible": False}}}]
    prompts = [[5, 9, 13], [100, 7], [7, 7, 3]]
    out = [engine.generate(p, max_new_tokens=32, structured_output=s).token_ids for p in prompts for s in specs]
    out += [o.token_ids for o in engine.generate_batch(prompts, max_new_tokens=32, structured_output=specs[0])]
    return out


def test_structured_helper_runs_on_the_cpu(agree_pair):
    """(the CUDA test's helper, eager on the CPU: it runs and the batch equals the singles)"""
    out = _structured_run(agree_pair, "cpu", compile=False)
    assert out[-3:] == [out[0], out[2], out[4]]


@cuda
def test_structured_outputs_on_cuda_graphs_equal_cpu(agree_pair):
    """float32, CUDA graphs: constrained greedy outputs (masks applied to the graphs'
    outputs, outside them) == the eager CPU engine's, alone and batched; no CUDA graph skipped.
    Skipped where llguidance is not installed (the GPU machine may have torch and
    transformers only)."""
    pytest.importorskip("llguidance")
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    want = _structured_run(agree_pair, "cpu", compile=False)
    got = _structured_run(agree_pair, "cuda", compile=True)
    assert compile_counts()[1] == 0
    assert got == want


@cuda
def test_joined_projections_on_cuda_graphs_equal_target_only_and_the_profile_sees_kernels(agree_pair):
    """The engine's CUDA default (joined projections, :mod:`dflash_torch.models.fusing`),
    compiled with CUDA graphs: the target-only tokens, no graph skipped, nothing
    recompiled; and the profiler summary records the kernels that graphs replay."""
    from dflash_torch.bench.profile import kernel_summary
    from dflash_torch.models.fusing import fuse_projections

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    target, drafter = _load(agree_pair, "cuda")
    fuse_projections(target, query=True)
    fuse_projections(drafter, query=False)
    plain = SpeculativeDecoder(_load(agree_pair, "cuda")[0], None)
    compiled = SpeculativeDecoder(target, drafter, compile=True, max_context=256)
    prompts = varied_prompts(target, 2)
    run_rounds(compiled, prompts[0], 100)  # warm-up
    frames, skips = compile_counts()
    assert skips == 0, "a compiled graph ran without CUDA graphs"
    for prompt in prompts:
        assert run_rounds(compiled, prompt, 100)[0] == run_rounds(plain, prompt, 100)[0]
    assert compile_counts() == (frames, 0), "recompiled after warm-up, or skipped CUDA graphs"
    s = kernel_summary(lambda: run_rounds(compiled, prompts[1], 30), 1, "cuda")
    assert s["kernels"] > 10 and "matmul" in s["by_kind"], s


@cuda
def test_eager_cuda_rounds_never_reach_cudnn_attention(agree_pair):
    """Eager rounds attend over a key length that changes every round; none of them may
    run cuDNN attention (a plan per new shape)."""
    target, drafter = _load(agree_pair, "cuda", torch.bfloat16)
    decoder = SpeculativeDecoder(target, drafter)
    prompt = varied_prompts(target, 1)[0]
    run_rounds(decoder, prompt, 20)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_rounds(decoder, prompt, 60)
    names = {e.key for e in prof.key_averages()}
    assert any("scaled_dot_product" in n for n in names)
    assert not [n for n in names if "cudnn_attention" in n]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_gpu_check_without_a_gpu_fails_at_once_in_one_line(tmp_path):
    """scripts/gpu_check.sh on a machine without CUDA: exit 2 and one line, before any
    part runs (it ran every part, printed a traceback and exited 0 with an empty table)."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    env = {k: v for k, v in os.environ.items() if k != "DEVICE"}
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(script), str(out), "probe,tests"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_gpu_scripts_without_a_gpu_fail_at_once_in_one_line(monkeypatch, capsys):
    """scripts/gpu_probe.py and scripts/gpu_profile.py (on its default device, cuda) on a
    machine without CUDA: exit 2 and one line, as gpu_check.sh (they gave an
    AssertionError's traceback, "Torch not compiled with CUDA enabled", trial-185). Their
    ``main()`` in this process (test_gpu_scripts' ``run_main``; a process spends seconds
    importing torch): a traceback would fail the test."""
    from test_gpu_scripts import run_main

    monkeypatch.delenv("DEVICE", raising=False)
    for name in ("gpu_probe", "gpu_profile"):
        code, out, err = run_main(name, [], monkeypatch, capsys)
        assert code == 2, out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{name}.py: error: no CUDA device"), err
        assert out == ""


def test_gpu_profile_refuses_an_unknown_shape_in_one_line(monkeypatch, capsys):
    """``DEVICE=cpu scripts/gpu_profile.py --shape nonexistent``: exit 2 and one line naming the
    shape (it was a DFlashError traceback). Its ``main()`` in this process, as above."""
    from test_gpu_scripts import run_main

    monkeypatch.setenv("DEVICE", "cpu")
    code, out, err = run_main("gpu_profile", ["--shape", "nonexistent"], monkeypatch, capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_profile.py: error: ") and "nonexistent" in lines[0], err
    assert out == ""
