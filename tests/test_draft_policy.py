"""``draft_max_batch_size="auto"`` (dflash_torch.draft_policy.DraftPolicy): each batched
round drafts or runs target-only by the measured goodput (tokens/s) of both kinds of
rounds at its number of sequences. Checked: the policy's decisions on given measurements
(each kind measured first, the faster one chosen, the other explored every
``explore_every`` rounds, a change in goodput followed, batch sizes kept apart); the batch
decoder with the policy switching kinds often is lossless (greedy output equals the
target's alone; attention, DFlash 2 and hybrid targets; eager and fixed shapes), runs both
kinds, and a compiled decoder warmed up builds no graph while it switches; the option is
checked and plumbed through ``from_pretrained``, ``serve`` and ``bench``."""

from __future__ import annotations

import json
import re

import pytest

from conftest import varied_prompts
from test_batch import agree_models, alone, qwen35_models  # noqa: F401 (fixtures)
from test_bench import run_bench

from dflash_torch import DFlashEngine, DFlashError, SamplingParams
from dflash_torch.batch import BatchDecoder
from dflash_torch.cli import main as cli_main
from dflash_torch.draft_policy import DraftPolicy

GREEDY = SamplingParams()


def decisions(policy: DraftPolicy, n: int, rounds: int, tau: float, seconds: dict[bool, float]) -> list[int]:
    """Run ``rounds`` rounds of ``n`` sequences where a drafting round commits ``tau``
    tokens per sequence in ``seconds[True]`` and a target-only one 1 in ``seconds[False]``
    -> the kinds chosen (1: drafted)."""
    out = []
    for _ in range(rounds):
        d = policy.draft(n)
        policy.record(n, d, n, round(tau * n) if d else n, seconds[d])
        out.append(int(d))
    return out


def test_policy_times_both_kinds_then_runs_the_faster_and_explores_the_other():
    """Drafting is timed over 4 rounds, target-only over 2 (each kind's first round at a
    batch size is not timed), then the kind of higher goodput runs, and every 4 rounds in
    a row the other kind runs again for its probe."""
    wins = DraftPolicy(explore_every=4)  # tau 3 in 0.2 s against 1 in 0.1 s: 15 against 10 tokens/s
    assert decisions(wins, 2, 14, 3.0, {True: 0.2, False: 0.1}) == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]
    assert wins.goodput(2) == {"draft": pytest.approx(15.0), "target_only": pytest.approx(10.0)}
    loses = DraftPolicy(explore_every=4)  # tau 1.5: 7.5 against 10 tokens/s
    assert decisions(loses, 8, 14, 1.5, {True: 0.2, False: 0.1}) == [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]


def test_tau_counts_the_sequences_that_decoded_not_the_rounds_rows():
    """tau is tokens per decoding sequence: a round of 4 sequences where 2 had used their
    budget (held as padding) and the other 2 committed 10 tokens has tau 5, not 2.5."""
    p = DraftPolicy(tau_smoothing=1.0)
    p.record(4, True, 2, 10, 0.2)
    assert p.tau == pytest.approx(5.0)
    p.record(4, True, 4, 8, 0.2)
    assert p.tau == pytest.approx(2.0)


def test_policy_skips_first_rounds_follows_a_change_and_keeps_batch_sizes_apart():
    p = DraftPolicy(explore_every=6, probe_rounds=2, smoothing=0.5, tau_smoothing=0.3)
    p.record(2, True, 2, 8, 5.0)  # a first drafting round at 2 sequences: its time is not counted, its tau is
    p.record(2, True, 2, 8, 0.2)
    assert p.goodput(2) == {"draft": pytest.approx(20.0)} and p.tau == pytest.approx(4.0)
    # drafting goes on until tau has 8 sequence-rounds, target-only is timed, drafting wins
    # and target-only is probed again after 6 rounds
    assert decisions(p, 2, 12, 4.0, {True: 0.2, False: 0.1}) == [1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    # the text turns hard to draft: drafting rounds commit 1.2 tokens per sequence, not 4
    later = decisions(p, 2, 40, 1.2, {True: 0.2, False: 0.1})
    assert later[-16:] == [1, 1, 0, 0, 0, 0, 0, 0] * 2  # target-only now, drafting only to explore
    # a batch size not timed yet goes by the nearest timed one (drafting loses there now)
    assert p.draft(1) is False and p.draft(5) is False and p.goodput(1) == {}
    back = decisions(p, 1, 40, 4.0, {True: 0.2, False: 0.1})  # the text turns easy again, at 1 sequence
    assert back[-8:] == [1, 1, 1, 1, 0, 0, 1, 1] and set(p.goodput(1)) == {"draft", "target_only"}
    # a single sequence: its first probe of drafting lasts until tau has 8 rounds
    assert decisions(DraftPolicy(explore_every=4), 1, 12, 3.0, {True: 0.2, False: 0.1}) == [1] * 8 + [0, 0, 1, 1]
    with pytest.raises(ValueError):
        DraftPolicy(explore_every=1)


def auto_run(target, drafter, prompts, static: bool = False, compile: bool = False):
    """Three sequences join and leave a decoder whose policy switches kinds every other
    round (``explore_every`` 2) -> outputs, the taus seen, and the decoder."""
    batch = BatchDecoder(target, drafter, max_batch_size=3, max_context=128, prefill_chunk=32, static=static,
                         compile=compile, draft_max_batch_size="auto", reuse_prefix=False)
    batch.policy = DraftPolicy(explore_every=2, probe_rounds=2)
    budgets = {0: 40, 1: 16, 2: 24}
    out, taus = {0: batch.add(0, prompts[0], GREEDY, 40).tokens}, []
    for sid in (1, 2):
        batch.join(sid, prompts[sid], GREEDY, budgets[sid])
    while batch.seq_ids or batch._joining:
        for sid, rnd in batch.step().items():
            out.setdefault(sid, []).extend(rnd.tokens)
            if rnd.acceptance_length is not None:
                taus.append(rnd.acceptance_length)
        for sid in batch.seq_ids:
            if len(out[sid]) >= budgets[sid]:
                batch.remove(sid)
    return {sid: out[sid][:budgets[sid]] for sid in out}, taus, batch


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shapes"])
@pytest.mark.parametrize("models", ["agree_models", "dflash2_models", "qwen35_models"],
                         ids=["attention", "dflash2", "qwen35-hybrid"])
def test_auto_rounds_are_lossless_while_switching(request, models, static):
    target, drafter = request.getfixturevalue(models)
    prompts = varied_prompts(target, 3, seed=11, length=7)
    out, taus, batch = auto_run(target, drafter, prompts, static=static)
    for sid, n in ((0, 40), (1, 16), (2, 24)):
        assert out[sid] == alone(target, None, prompts[sid], n), sid
    assert batch.target_only_rounds > 0 and len(batch.policy.goodput(3)) == 2  # both kinds timed with 3 sequences
    if models != "qwen35_models":  # (the agreeable pairs: drafting rounds commit several tokens)
        assert max(taus) > 1


def test_compiled_auto_decoder_warmed_up_switches_without_new_graphs(agree_models):  # noqa: F811
    """TorchDynamo's guards decide whether a graph is built, before any backend runs: the
    cheap "eager" backend sees the same graphs (inductor's batch rounds: test_target_only_rounds)."""
    from torch._dynamo.utils import counters

    target, drafter = agree_models
    batch = BatchDecoder(target, drafter, max_batch_size=2, max_context=64, prefill_chunk=32, compile=True,
                         compile_backend="eager", draft_max_batch_size="auto", reuse_prefix=False)
    assert batch.warmup() == 4  # drafting and target-only rounds of 1 and of 2 rows (one length bucket)
    frames = sum(counters["frames"].values())
    batch.policy = DraftPolicy(explore_every=2, probe_rounds=2)
    prompts = varied_prompts(target, 2, seed=12, length=5)
    out = {0: batch.add(0, prompts[0], GREEDY, 20).tokens, 1: batch.add(1, prompts[1], GREEDY, 20).tokens}
    while min(map(len, out.values())) < 20:
        for sid, rnd in batch.step().items():
            out[sid] += rnd.tokens
    assert sum(counters["frames"].values()) == frames  # no graph built after the warm-up
    assert batch.target_only_rounds > 0
    assert all(out[i][:20] == alone(target, None, prompts[i], 20) for i in (0, 1))


def test_auto_is_checked_and_plumbed(agree_pair, agree_models, tiny_pair, tmp_path, capsys, cli):  # noqa: F811
    target, drafter = agree_models
    for command in ("serve", "bench"):
        with pytest.raises(SystemExit) as exit_:
            cli_main([command, "--draft-max-batch-size", "sometimes"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1
        assert "--draft-max-batch-size: must be an integer or 'auto', got 'sometimes'" in err[0]
    for bad in ("Auto", "", 0, 2.0):
        with pytest.raises(DFlashError, match="^draft_max_batch_size must be an integer >= 1 or 'auto'"):
            BatchDecoder(target, drafter, max_batch_size=2, max_context=64, draft_max_batch_size=bad)
    engine = DFlashEngine.from_pretrained(*agree_pair, max_batch_size=2, draft_max_batch_size="auto")
    assert isinstance(engine.batch_decoder().policy, DraftPolicy)
    out = tmp_path / "out"
    proc = run_bench(cli, tiny_pair, "--max-new-tokens", "10", "--num-prompts", "3", "--modes", "", "--sweep", "",
                     "--batch-sizes", "3", "--block-size", "4", "--draft-max-batch-size", "auto", "--out", str(out),
                     "--no-progress")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "bench.json").read_text())
    assert report["draft_max_batch_size"] == "auto"
    assert report["batch_sizes"][1]["outputs_identical_to_target_only"] is True
    dflash = report["batch_sizes"][1]  # (how many rounds the policy ran without drafts: measured, so any share)
    assert 0 <= dflash["target_only_rounds"] <= dflash["rounds"]
    assert re.search(rf"\| 3 \| dflash \| [\d.]+ \| {dflash['target_only_rounds']} of {dflash['rounds']} \|",
                     proc.stdout), proc.stdout
