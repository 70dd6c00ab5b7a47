"""When a batched round drafts: the adaptive policy behind ``draft_max_batch_size="auto"``.

Drafting pays when the tokens a round commits per sequence (its acceptance length tau)
grow more than the round's time does over a target-only round (one token per sequence).
How much a verify of ``n x B`` rows costs against one of ``n`` rows depends on the device
(compute-bound on a CPU, memory-bound on a GPU up to a large batch), and tau depends on
the text, so no fixed batch size suits every machine and workload. This policy measures
both instead:

* for each number of sequences ``n``, a moving average of the wall time of drafting
  rounds and of target-only rounds (seconds; the first round of each kind at ``n`` is not
  counted, as it pays one-off costs such as allocations and kernel selection, nor is the
  injection of the context that target-only rounds left, a cost of switching);
* over all drafting rounds, a moving average of tau (tokens committed per sequence,
  over about the last 20 sequence-rounds: one round's tau is far noisier than its time;
  the first probe of drafting lasts until 8 have been seen).

Both averages weigh each measurement ``smoothing * (1 - smoothing) ** age``, normalised by
the weights so far (so the first few measurements are simply averaged).

A round of ``n`` sequences drafts when ``tau / t_draft(n) >= 1 / t_target_only(n)``: the
kind with the higher *goodput* (tokens per second). The first rounds time each kind
(drafting, then target-only); a number of sequences where the two are not both timed yet
goes by the nearest one where they are; and after ``explore_every`` rounds in a row of
one kind at ``n`` the other kind runs for a few rounds (drafting ``probe_rounds``, as one
round's tau says little; target-only 2), so the estimates follow the text and the context
length as they change.

Choosing speculation by goodput follows SmartSpec (Liu et al., "Optimizing Speculative
Decoding for Serving Large Language Models Using Goodput", 2024), which predicts it from
a cost model; here it is measured. The output does not depend on the choice: target-only
and drafting rounds are both lossless (a seeded sample does depend on it, as with a fixed
``draft_max_batch_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_TAU_SAMPLES = 8  # sequence-rounds of drafting before tau is trusted


class _Average:
    """An exponentially weighted moving average, normalised by the weights so far."""

    def __init__(self, smoothing: float):
        self.smoothing, self.total, self.weight, self.count = smoothing, 0.0, 0.0, 0

    def add(self, x: float, count: int = 1) -> None:
        """``count`` measurements of value ``x``."""
        w = 1 - (1 - self.smoothing) ** count
        self.total, self.weight, self.count = self.total * (1 - w) + w * x, self.weight * (1 - w) + w, self.count + count

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.count else None


@dataclass
class _Timings:
    """What the policy knows of rounds of one number of sequences."""

    seconds: dict[bool, _Average] = field(default_factory=dict)  # drafted -> the round time
    seen: dict[bool, int] = field(default_factory=dict)  # drafted -> rounds run
    last: bool | None = None  # the kind of the last round
    run: int = 0  # rounds in a row of that kind
    probe: int = 0  # rounds of the kind ``last`` still to run before deciding again


class DraftPolicy:
    """Decides, round by round, whether a batched round of ``n`` sequences drafts.

    Args:
        explore_every: after this many rounds in a row of one kind at ``n``, a few rounds
            of the other kind (>= 2).
        probe_rounds: drafting rounds run at a time to measure it (>= 2; target-only: 2).
        smoothing: weight of a new round time in its moving average, in (0, 1].
        tau_smoothing: weight of one sequence's acceptance length in the moving average of
            tau, in (0, 1] (a round of k sequences weighs ``1 - (1 - tau_smoothing) ** k``):
            one round's tau varies much more than its time does.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, explore_every: int = 32, probe_rounds: int = 4, smoothing: float = 0.2,
                 tau_smoothing: float = 0.05):
        if explore_every < 2 or probe_rounds < 2 or not (0 < smoothing <= 1 and 0 < tau_smoothing <= 1):
            raise ValueError("explore_every and probe_rounds must be >= 2, smoothing and tau_smoothing in (0, 1]")
        self.explore_every, self.probe_rounds = explore_every, probe_rounds
        self.smoothing, self.tau_smoothing = smoothing, tau_smoothing
        self._tau = _Average(tau_smoothing)  # tokens committed per sequence in drafting rounds
        self._by_n: dict[int, _Timings] = {}

    def draft(self, n: int) -> bool:
        """Whether the next round of ``n`` sequences should draft."""
        e = self._by_n.setdefault(n, _Timings())
        if e.probe:
            return e.last
        ratio = self._ratio(n)
        if ratio is None:  # nothing timed yet: time each kind, drafting first
            return self._probe(e, True not in e.seconds)
        best = self.tau >= ratio  # (tau / t_draft >= 1 / t_target_only)
        return self._probe(e, not best) if e.last == best and e.run >= self.explore_every else best

    def _ratio(self, n: int) -> float | None:
        """``t_draft / t_target_only`` at ``n`` sequences, or where both are timed at the
        nearest number of sequences (a batch draining through sizes not timed yet need not
        probe each); None where neither is."""
        timed = [m for m, e in self._by_n.items() if len(e.seconds) == 2]
        if not timed:
            return None
        s = self._by_n[min(timed, key=lambda m: (abs(m - n), m))].seconds
        return s[True].value / s[False].value

    def _probe(self, e: _Timings, kind: bool) -> bool:
        """Start a run of rounds of ``kind`` to measure it -> ``kind``."""
        e.last, e.run, e.probe = kind, 0, self.probe_rounds if kind else 2
        return kind

    def record(self, n: int, drafted: bool, sequences: int, tokens: int, seconds: float) -> None:
        """A round of ``n`` sequences ran: it ``drafted`` (or not); ``sequences`` of them
        decoded (the others had used their budget) and committed ``tokens`` tokens in all,
        in ``seconds`` of wall time (without the injection of a backlog of context)."""
        e = self._by_n.setdefault(n, _Timings())
        e.run = e.run + 1 if drafted == e.last else 1
        e.last, e.probe = drafted, max(e.probe - 1, 0)
        e.seen[drafted] = e.seen.get(drafted, 0) + 1
        if drafted and sequences:
            self._tau.add(tokens / sequences, sequences)
            if not e.probe and self._tau.count < MIN_TAU_SAMPLES:  # (the first probe: until tau means something)
                e.probe = 1
        if e.seen[drafted] > 1 and seconds > 0:  # (the first round of a kind at n: one-off costs)
            e.seconds.setdefault(drafted, _Average(self.smoothing)).add(seconds)

    @property
    def tau(self) -> float | None:
        """The estimated acceptance length of a drafting round (tokens per sequence), or None."""
        return self._tau.value

    def goodput(self, n: int) -> dict[str, float]:
        """The current estimates at ``n`` in tokens per second per sequence:
        ``{"draft": tau / t_draft, "target_only": 1 / t_target_only}``, the timed kinds only."""
        s = self._by_n.get(n, _Timings()).seconds
        out = {}
        if True in s:
            out["draft"] = self.tau / s[True].value
        if False in s:
            out["target_only"] = 1 / s[False].value
        return out
