"""Rounds above ``draft_max_batch_size`` run target-only (dflash_torch.batch): every
sequence's block is its one committed token; its verified rows' features are kept (with
the accepted rows of a drafting round still waiting for the next propose) and injected
into its drafter context in one pass when it drafts again, leaves with its rows retained,
or has BACKLOG_ROWS of them. Checked: greedy
output equals the target's alone while rounds switch between drafting and target-only
(attention, DFlash 2 and hybrid targets; eager and fixed shapes); rounds of more
sequences than the limit commit one token each and drafting resumes below it; after
target-only rounds, a retained sequence's rows (target K/V, drafter context, recurrent
state) and a sequence's context rows once it drafts again equal those of a prefill of its
committed tokens (the context invariant); a compiled decoder
warmed up builds no graph while crossing the limit."""

from __future__ import annotations

import pytest
import torch

from conftest import varied_prompts
from test_batch import agree_models, alone, qwen35_models  # noqa: F401 (fixtures)
from test_errors import _free_port
from test_prefix_reuse import slot_rows

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch import batch as batch_module
from dflash_torch.batch import BatchDecoder

GREEDY = SamplingParams()


def prefilled_rows(target, drafter, ids: list[int], state: bool = True) -> torch.Tensor:
    """What a prefill of ``ids`` leaves in a slot (rows ``[0, len(ids))``; the prompt's
    last token is read too, as every committed token before ``s`` was)."""
    batch = BatchDecoder(target, drafter, max_batch_size=1, max_context=160, prefill_chunk=32, reuse_prefix=False)
    batch.add(0, ids, GREEDY, 1)
    return slot_rows(batch, 0, len(ids), state)


def run(target, drafter, prompts, static: bool = False):
    """Sequence 0 decodes alone (drafting), 1 and 2 join (3 sequences > the limit of 1:
    target-only rounds), 1 and 2 leave (their rows retained in free slots) and 0 drafts
    alone again. -> outputs, every sequence's (round size, tau) pairs, and the rows
    checks: 1's and 2's retained rows, 0's context rows after its first drafting round."""
    batch = BatchDecoder(target, drafter, max_batch_size=5, max_context=160, prefill_chunk=32, static=static,
                         draft_max_batch_size=1)
    out = {0: batch.add(0, prompts[0], GREEDY, 60).tokens}
    taus = {0: [], 1: [], 2: []}
    sizes = []

    def step():
        n = len(batch._seqs)
        sizes.append(n)
        for sid, rnd in batch.step().items():
            out.setdefault(sid, []).extend(rnd.tokens)
            if rnd.acceptance_length is not None:
                taus[sid].append((n, rnd.acceptance_length))

    for _ in range(3):
        step()
    for sid in (1, 2):
        out[sid] = batch.add(sid, prompts[sid], GREEDY, 12).tokens
    while min(len(out[1]), len(out[2])) < 12:
        step()
    batch.remove(1)
    batch.remove(2)
    assert len(batch._retained) == 2
    checks = [(slot_rows(batch, slot, len(r.ids)), prefilled_rows(target, drafter, r.ids))
              for slot, r in batch._retained.items()]
    q = batch._seqs[0]
    s, ids = q.s, list(q.ids)
    step()  # a drafting round: the context of every committed token before it is in place
    checks.append((slot_rows(batch, 0, s, state=False), prefilled_rows(target, drafter, ids[:s], state=False)))
    while len(out[0]) < 60:
        step()
    assert batch.target_only_rounds == sum(n > 1 for n in sizes) > 0
    return out, taus, checks


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shapes"])
@pytest.mark.parametrize("models", ["agree_models", "dflash2_models", "qwen35_models"],
                         ids=["attention", "dflash2", "qwen35-hybrid"])
def test_rounds_above_the_limit_run_target_only_and_keep_every_context(request, models, static, monkeypatch):
    """(With fixed shapes a backlog is also injected every 5 rows, on the way.)"""
    target, drafter = request.getfixturevalue(models)
    if static:
        monkeypatch.setattr(batch_module, "BACKLOG_ROWS", 5)
    prompts = varied_prompts(target, 3, seed=5, length=7)
    out, taus, checks = run(target, drafter, prompts, static=static)
    for sid, n in ((0, 60), (1, 12), (2, 12)):
        assert out[sid][:n] == alone(target, None, prompts[sid], n), sid
    assert all(tau == 1 for sid in taus for n, tau in taus[sid] if n > 1)  # target-only rounds: one token each
    assert {n for n, _ in taus[0]} == {1, 3}  # 0 decoded alone, then with 1 and 2, then alone again
    for got, want in checks:  # the rows after target-only rounds are those of a prefill of the same tokens
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if models != "qwen35_models":  # (the agreeable pairs: drafting pays again once 0 is alone)
        assert max(tau for n, tau in taus[0][-5:]) > 1


def test_the_limit_is_checked_and_plumbed(agree_pair, agree_models):  # noqa: F811 (the imported fixture)
    target, drafter = agree_models
    for bad in (0, -1, 1.5, True):
        with pytest.raises(DFlashError, match="^draft_max_batch_size must be an integer >= 1"):
            BatchDecoder(target, drafter, max_batch_size=2, max_context=64, draft_max_batch_size=bad)
    with pytest.raises(DFlashError, match="^draft_max_batch_size must be an integer >= 1 or 'auto', got 0$"):
        DFlashEngine.from_pretrained(*agree_pair, draft_max_batch_size=0)
    engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=2, draft_max_batch_size=1)
    assert engine.batch_decoder().draft_max_batch_size == 1
    assert [engine.batch_decoder().round_block(n) for n in (1, 2)] == [16, 1]


def test_a_limit_where_no_round_drafts_is_refused(agree_pair, agree_models, tmp_path, capsys):  # noqa: F811
    """``draft_max_batch_size`` (a number or ``"auto"``) without a drafter, with
    ``draft_mode="recompute"`` (one sequence at a time) or with block size 1 would change
    nothing: the Python API raises one line before reading a weight, ``serve`` and
    ``bench`` exit 2 with one line naming the flags."""
    from dflash_torch.cli import main as cli_main

    target, drafter = agree_models
    none = "has no effect without a drafter (no_draft: every round is target-only); drop it"
    recompute = "has no effect with draft_mode 'recompute' (it decodes one sequence at a time); drop it"
    one = "has no effect with block size 1 (every round is target-only); drop it"
    for limit in (2, "auto"):
        for kw, words in ((dict(no_draft=True), none), (dict(draft_mode="recompute"), recompute),
                          (dict(block_size=1), one)):
            pair = agree_pair[:1] if kw.get("no_draft") else agree_pair
            with pytest.raises(DFlashError) as err:
                DFlashEngine.from_pretrained(*pair, draft_max_batch_size=limit, **kw)
            assert str(err.value) == f"draft_max_batch_size {words}", kw
        with pytest.raises(DFlashError, match=f"^draft_max_batch_size {none.replace('(', '.').replace(')', '.')}$"):
            BatchDecoder(target, None, max_batch_size=2, max_context=64, draft_max_batch_size=limit)
        with pytest.raises(DFlashError, match=f"^draft_max_batch_size {one.replace('(', '.').replace(')', '.')}$"):
            BatchDecoder(target, drafter, block_size=1, max_batch_size=2, max_context=64, draft_max_batch_size=limit)
    flags = {none: "--draft-max-batch-size has no effect without a drafter (--no-draft: every round is target-only)",
             recompute: "--draft-max-batch-size has no effect with --draft-mode 'recompute' (it decodes one sequence at "
                        "a time)",
             one: "--draft-max-batch-size has no effect with --block-size 1 (every round is target-only)"}
    port = str(_free_port())
    for argv, words in (
        (["serve", "--target", str(agree_pair[0]), "--no-draft", "--port", port, "--draft-max-batch-size", "auto"], none),
        (["serve", "--target", str(agree_pair[0]), "--draft", str(agree_pair[1]), "--port", port, "--draft-mode",
          "recompute", "--draft-max-batch-size", "2"], recompute),
        (["bench", "--target", str(agree_pair[0]), "--draft", str(agree_pair[1]), "--modes", "", "--sweep", "",
          "--batch-sizes", "2", "--block-size", "1", "--draft-max-batch-size", "1", "--out", str(tmp_path / "out")],
         one),
    ):
        rc = cli_main(argv)
        captured = capsys.readouterr()
        assert rc == 2 and captured.err == f"dflash-torch: error: {flags[words]}; drop it\n", captured.err
        # (serve says what it loads before the pair checks its options: that one line only)
        assert captured.out == "" or (argv[0] == "serve" and captured.out.startswith("dflash-torch: loading ")
                                      and captured.out.count("\n") == 1), captured.out
    assert not (tmp_path / "out").exists()


def test_compiled_decoder_warmed_up_crosses_the_limit_without_new_graphs(agree_models):  # noqa: F811
    from torch._dynamo.utils import counters

    target, drafter = agree_models
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=64, prefill_chunk=32, compile=True,
                         draft_max_batch_size=1, reuse_prefix=False)
    assert batch.warmup() == 2  # a drafting round of 1 row, a target-only round of 2 (one length bucket)
    frames = sum(counters["frames"].values())
    prompts = varied_prompts(target, 2, seed=9, length=5)
    out = {0: batch.add(0, prompts[0], GREEDY, 20).tokens}
    for _ in range(2):
        out[0] += batch.step()[0].tokens
    out[1] = batch.add(1, prompts[1], GREEDY, 8).tokens
    while len(out[1]) < 8:
        for sid, rnd in batch.step().items():
            out[sid] += rnd.tokens
    batch.remove(1)
    while len(out[0]) < 20:
        out[0] += batch.step()[0].tokens
    assert sum(counters["frames"].values()) == frames  # no graph built after the warm-up
    assert out[0][:20] == alone(target, None, prompts[0], 20) and out[1][:8] == alone(target, None, prompts[1], 8)
