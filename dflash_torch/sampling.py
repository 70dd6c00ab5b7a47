"""Sampling parameters, logits processing and the acceptance rules of speculative decoding.

Acceptance rules (both lossless: the output is distributed as the target's alone):

* greedy: the longest prefix of draft tokens equal to the target's argmax, then the
  target's argmax at the first mismatch (the bonus / correction token);
* sampling: speculative rejection sampling (Leviathan et al., "Fast Inference from
  Transformers via Speculative Decoding", 2023; Chen et al., 2023): draft token
  ``d_j ~ q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the
  first rejection a token is drawn from ``normalize(max(p_j - q_j, 0))``; if all are
  accepted the bonus token is drawn from ``p_B``. ``p`` and ``q`` are the target's and
  the drafter's distributions after temperature, top-k, min-p and top-p.

Logit bias, penalties (presence, frequency, repetition; :func:`penalize`, :class:`Penalties`),
min_tokens and a structured-output grammar (:mod:`dflash_torch.structured`) change the
target's logits before either rule, per block position (:class:`LogitsProcessor`), so both
stay lossless for the processed target (see :func:`penalize`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

from .errors import DFlashError, OptionError, shown
from .structured import Grammar, GrammarState, frozen


MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's limit of top_logprobs)
# (what a bool logprobs, OpenAI's logprobs=True, is told: this one is the number of alternatives, top_logprobs)
LOGPROBS_BOOL_HINT = (" (the number of most likely tokens reported beside each token, as OpenAI's top_logprobs; 0: "
                      "the chosen token's log-probability alone, as OpenAI's logprobs=True without top_logprobs)")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range of a logit_bias value: [-100, 100]


def _real(x) -> float | None:
    """``x`` as a float; None for a non-number, a bool, or an int too large for a float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


@dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens.

    Attributes:
        temperature: 0 for greedy decoding, else any finite value > 0 (logits are divided
            by it; see :func:`probabilities`). Stored as a float.
        top_k: keep the k most likely tokens (0 = no limit; -1, vLLM's spelling, is taken as 0).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1 = off);
            the most likely token is always kept. Stored as a float.
        min_p: in [0, 1] (0 = off; vLLM's and transformers' ``min_p``): after temperature,
            drop the tokens whose probability is below ``min_p`` times the most likely
            token's (before top-p, as vLLM orders them). Stored as a float.
        seed: seed of the request's random generator (None = nondeterministic), an
            integer in [-2**63, 2**64), taken modulo 2**64. On a CPU (whose generator,
            torch's Mersenne Twister, keeps 32 bits of a seed) a seed outside [0, 2**32)
            seeds it with a BLAKE2b hash of its 64 bits, so that seeds differing only
            above bit 31 sample differently.
        logprobs: report each generated token's log-probability (:func:`token_logprobs`)
            with this many most likely alternatives, 0 to :data:`MAX_LOGPROBS` (0: the
            chosen token's only); None (default): none, at no cost. Does not change
            which tokens are chosen.
        presence_penalty: in [-2, 2] (0 = off, OpenAI's range): subtracted from the logit
            of every token generated so far (:func:`penalize`). Stored as a float.
        frequency_penalty: in [-2, 2] (0 = off): times each token's count among the
            generated tokens, subtracted from its logit. Stored as a float.
        repetition_penalty: > 0 (1 = off): the logit of every token of the prompt or
            generated so far is divided by it when positive, else multiplied by it
            (a result beyond float32's range is clamped to it). Stored as a float.
        logit_bias: token id (an int, or its decimal string as in an OpenAI request body)
            -> bias in [-100, 100] (OpenAI's ``logit_bias``), added to the
            target's logits before penalties, temperature, top-k, top-p and the greedy
            argmax: -100 in effect bans a token, 100 forces it. Stored as a new dict of
            int -> float; None (default) or empty: off. Ids are checked against the
            vocabulary by the engine (only it knows the vocabulary).
        min_tokens: the first ``min_tokens`` generated tokens cannot be a stop token
            (vLLM's ``min_tokens``): the logits of ``min_tokens_ids`` are -inf there (the
            engine also ignores stop strings completed within them, see
            :class:`~dflash_torch.stopping.Stopper`). 0 (default): off.
        min_tokens_ids: the token ids ``min_tokens`` holds back. The engine sets them to the
            request's stop token ids (the model's EOS ids unless ``ignore_eos``, plus
            ``stop_token_ids``); given directly (to a decoder), any ids in the vocabulary.
        grammar: a compiled structured-output constraint
            (:class:`~dflash_torch.structured.Grammar`, from the engine's
            :class:`~dflash_torch.structured.GrammarCompiler`): at every position the tokens
            it does not allow get -inf, after everything else. None (default): off.

    The reported logprobs (``logprobs``) stay those of the raw logits, before logit_bias,
    penalties and min_tokens (see :func:`token_logprobs`).

    Raises:
        OptionError: a value out of its range or of the wrong type (the message names the field).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    min_tokens_ids: frozenset[int] = field(default=frozenset())
    grammar: "Grammar | None" = None

    def __post_init__(self):
        t = _real(self.temperature)
        if t is None or not math.isfinite(t) or t < 0:
            raise OptionError(f"temperature must be a finite number >= 0, got {shown(self.temperature)}", "temperature")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise OptionError(f"top_k must be an integer >= -1 (0 or -1 = off), got {shown(self.top_k)}", "top_k")
        if self.top_k == -1:  # (vLLM's and the OpenAI server's spelling of off)
            object.__setattr__(self, "top_k", 0)
        p = _real(self.top_p)
        if p is None or not (0 < p <= 1):
            raise OptionError(f"top_p must be in (0, 1], got {shown(self.top_p)}", "top_p")
        m = _real(self.min_p)
        if m is None or not 0 <= m <= 1:
            raise OptionError(f"min_p must be in [0, 1] (0 = off), got {shown(self.min_p)}", "min_p")
        object.__setattr__(self, "min_p", m)
        object.__setattr__(self, "temperature", t)  # floats from here on (an int such as 10**30 would overflow torch)
        object.__setattr__(self, "top_p", p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise OptionError(f"seed must be an integer in [-2**63, 2**64), got {shown(self.seed)}", "seed")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise OptionError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {shown(self.logprobs)}"
                              + LOGPROBS_BOOL_HINT * isinstance(self.logprobs, bool), "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            x = _real(getattr(self, name))
            if x is None or not -2 <= x <= 2:
                raise OptionError(f"{name} must be a number in [-2, 2], got {shown(getattr(self, name))}", name)
            object.__setattr__(self, name, x)
        r = _real(self.repetition_penalty)
        if r is None or not math.isfinite(r) or r <= 0:
            raise OptionError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                              f"{shown(self.repetition_penalty)}", "repetition_penalty")
        object.__setattr__(self, "repetition_penalty", r)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise OptionError(f"min_tokens must be an integer >= 0 (0 = off), got {shown(self.min_tokens)}", "min_tokens")
        ids = self.min_tokens_ids
        if not isinstance(ids, (set, frozenset, list, tuple)) or not all(_is_token_id(t) for t in ids):
            raise OptionError(f"min_tokens_ids must be a set of token ids (integers >= 0), got {shown(ids)}", "min_tokens_ids")
        object.__setattr__(self, "min_tokens_ids", frozenset(ids))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise OptionError(f"grammar must be a compiled structured_output (dflash_torch.structured.Grammar), got "
                              f"{type(self.grammar).__name__}", "grammar")
        if self.grammar is not None and self.min_tokens:
            raise OptionError("min_tokens cannot be combined with a structured output: the constraint decides where "
                              "the output may end", "min_tokens", "structured_output")

    def __hash__(self) -> int:
        """A hash that equal params share (``logit_bias`` compared as a dict: its items in any
        order): over the fields, ``logit_bias`` as its frozenset of items (:func:`~dflash_torch.structured.frozen`)."""
        return hash(tuple(frozen(getattr(self, f.name)) for f in fields(self)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether anything changes the target's logits before a token is chosen (a logit
        bias, a penalty, min_tokens with ids to hold back, a grammar): see :class:`LogitsProcessor`."""
        return (self.penalized or self.logit_bias is not None or bool(self.min_tokens and self.min_tokens_ids)
                or self.grammar is not None)

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_vocab(self, vocab_size: int) -> None:
        """Check the token ids of ``logit_bias`` and ``min_tokens_ids`` against the vocabulary.

        Raises:
            OptionError: an id >= ``vocab_size`` (the message names the field), or
                ``min_tokens`` with ``min_tokens_ids`` that cover the whole vocabulary (no
                token is left to generate: greedy decoding chose a held-back id, sampling
                raised torch's "probability tensor contains inf/nan").
        """
        for name, ids in (("logit_bias", self.logit_bias or ()), ("min_tokens_ids", self.min_tokens_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise OptionError(f"{name} token ids must be in [0, {vocab_size}) (the vocabulary), got "
                                  f"{_key_shown(min(bad))}",
                                  name)
        if self.min_tokens and covers_vocab(self.min_tokens_ids, vocab_size):
            raise OptionError(f"min_tokens ({self.min_tokens}) holds back every id of min_tokens_ids until then, and "
                              f"they cover the whole vocabulary ({vocab_size} ids): no token is left to generate; drop "
                              "min_tokens or some min_tokens_ids", "min_tokens", "min_tokens_ids")

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """A random generator for one request (None for greedy decoding)."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        elif g.device.type == "cpu" and not 0 <= self.seed < 2**32:  # (see seed)
            digest = hashlib.blake2b((self.seed % 2**64).to_bytes(8, "little"), digest_size=4).digest()
            g.manual_seed(int.from_bytes(digest, "little"))
        else:
            g.manual_seed(self.seed)
        return g


def covers_vocab(ids: set[int] | frozenset[int], vocab_size: int) -> bool:
    """Whether ``ids`` hold every token id of a vocabulary of ``vocab_size`` (min_tokens would
    leave no token to generate: :meth:`SamplingParams.check_vocab`)."""
    return len(ids) >= vocab_size and ids.issuperset(range(vocab_size))


# generation_config.json fields that set a server request's defaults (vLLM's list, ModelConfig.get_diff_sampling_param)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")


def generation_defaults(config: dict, where: str = "generation_config.json") -> dict:
    """The sampling defaults a model's ``generation_config.json`` recommends: those of
    :data:`GENERATION_DEFAULT_FIELDS` it sets (a null is unset): ``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``repetition_penalty`` (keyword arguments of
    :meth:`DFlashEngine.generate`: :attr:`DFlashEngine.generation_defaults`) and
    ``max_new_tokens`` (the engine's default, cut to the context a prompt leaves:
    :attr:`DFlashEngine.default_max_new_tokens`). ``top_k`` -1 (vLLM's "off") is 0.
    ``do_sample`` is not read (as vLLM, which applies these values whatever it says).

    Raises:
        DFlashError: a value out of its range or of the wrong type; the message names
            ``where`` and the field.
    """
    out = {k: config[k] for k in GENERATION_DEFAULT_FIELDS if config.get(k) is not None}
    for k in ("top_k", "max_new_tokens"):  # (20.0 is 20)
        if isinstance(out.get(k), float) and out[k].is_integer():
            out[k] = int(out[k])
    if out.get("top_k") == -1:
        out["top_k"] = 0
    try:
        SamplingParams(**{k: v for k, v in out.items() if k != "max_new_tokens"})
    except OptionError as exc:
        raise DFlashError(f"{where}: {exc}") from None  # (a file's field: not an option to rename as a flag)
    n = out.get("max_new_tokens")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise DFlashError(f"{where}: max_new_tokens must be an integer >= 1, got {shown(n)}")
    return out


def _is_token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _key_shown(key) -> str:
    """A ``logit_bias`` key (or token id) as a message shows it: its repr, or for a string of
    over 20 characters (``"000…5"``: leading zeros are unbounded) its length, for an integer
    of over 20 digits its size (Python refuses to print one of over 4300 digits)."""
    if isinstance(key, str) and len(key) > 20:
        return f"a key of {len(key)} characters"
    return shown(key)


def check_logit_bias(bias) -> dict[int, float] | None:
    """``SamplingParams.logit_bias`` checked: a new dict of int ids -> float biases, None when empty.

    Raises:
        OptionError: not a mapping, a key that is not an integer >= 0, a value that is not a
            number in [-100, 100], two keys of one token (``5`` and ``"5"``, ``"5"`` and ``"05"``).
    """
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise OptionError(f"logit_bias must be a mapping of token ids to biases, got {shown(bias)}", "logit_bias")
    out, keys = {}, {}  # (keys: token id -> the key that gave it)
    for key, value in bias.items():
        token = key
        if isinstance(token, str) and token.isascii() and token.isdigit() and len(token.lstrip("0")) <= 18:
            # (an OpenAI request body's key: "50256"; longer ones are no vocabulary's ids; int() refuses
            # strings of over 4300 digits, leading zeros too)
            token = int(token.lstrip("0") or "0")
        if not _is_token_id(token):
            raise OptionError(f"logit_bias keys must be token ids (integers >= 0, or their decimal strings), "
                              f"got {_key_shown(token)}", "logit_bias")
        if token in keys:  # (5 and "5", or "5" and "05": which bias is meant?)
            raise OptionError(f"logit_bias gives token {token} twice (as {_key_shown(keys[token])} and "
                              f"{_key_shown(key)})", "logit_bias")
        keys[token] = key
        x = _real(value)
        if x is None or not -MAX_LOGIT_BIAS <= x <= MAX_LOGIT_BIAS:
            raise OptionError(f"logit_bias values must be numbers in [-100, 100], got {shown(value)} for token {token}",
                              "logit_bias")
        out[token] = x
    return out or None


_F32 = torch.finfo(torch.float32)


class TokenLogprob(NamedTuple):
    """A token and its log-probability under the target (natural log, float): a generated
    token (``logprobs``), or a prompt token given the tokens before it (``prompt_logprobs``).

    Attributes:
        token_id: the token.
        logprob: its log-probability.
        top: the ``SamplingParams.logprobs`` most likely tokens at that position, most
            likely first, as ``(token_id, logprob)`` pairs (empty for 0).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of the tokens chosen at ``N`` positions, from the target's logits there.

    The distribution is ``log_softmax`` of the raw logits in float32, before logit bias,
    penalties, min_tokens, temperature, top-k and top-p (vLLM's default, "raw"
    log-probabilities): it depends on the position only, not on how the token was chosen.

    Args:
        logits: ``[N, V]`` target logits (any float dtype), row i the position of ``tokens[i]``.
        tokens: the ``N`` chosen token ids.
        top: most likely alternatives to report per position (>= 0; at most ``V`` are).

    Returns:
        ``N`` :class:`TokenLogprob` (one device-to-host transfer).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
    # one transfer; float64 holds every float32 and every token id exactly
    rows = torch.cat([chosen.double(), values.double(), ids.double()], dim=-1).tolist()
    k = values.shape[-1]
    return [TokenLogprob(t, row[0], [(int(i), v) for i, v in zip(row[1 + k:], row[1:1 + k])])
            for t, row in zip(tokens, rows)]


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits ``[N, V]`` (any float dtype, finite) -> float32 probabilities ``[N, V]``
    after top-k, temperature, min-p and top-p (vLLM's order: top-p sees the distribution
    min-p left; top-k and min-p commute). Only for ``params.temperature > 0``.

    Top-k keeps every token tied with the k-th. Well defined for every accepted
    temperature: the row maximum is subtracted before scaling, so the most likely
    token's scaled logit is exactly 0 and nothing overflows to +inf; a temperature
    outside float32's normal range (below ~1.2e-38 or above ~3.4e38) is applied in
    float64. A temperature small enough that every gap to the maximum, scaled, is
    beyond exp's range gives the limit distribution: uniform over the tokens tied for
    the maximum (one-hot without ties); a huge one gives the uniform distribution.
    Top-p ranks equally likely tokens by id (lower first) and always keeps the most
    likely token.
    """
    x = logits.float()
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    gaps = x - x.amax(dim=-1, keepdim=True)  # <= 0, exactly 0 at the maximum and its ties
    t = params.temperature
    # min-p: p / p_max = exp(gap / t) < min_p, tested on the gaps (exact where float32
    # probabilities round to equal values, a huge temperature; the maximum always stays)
    below_min_p = gaps < t * math.log(params.min_p) if params.min_p > 0.0 else None
    if _F32.tiny <= t <= _F32.max:
        scaled = gaps.div_(t)
    else:  # not a normal float32: 1e-40 would lose precision, 1e-46 or 1e39 would become 0 or inf
        scaled = (gaps.double() / t).float()
    probs = torch.softmax(scaled, dim=-1)
    if below_min_p is not None:
        probs = probs.masked_fill(below_min_p, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        # most likely first, ordered by the logits: probabilities that round to equal values
        # (a huge temperature) still put the true maximum first
        order = x.argsort(dim=-1, descending=True, stable=True)
        sorted_p = probs.gather(-1, order)
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor | None, ids: torch.Tensor,
             params: SamplingParams, draft: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of a verify block (or of one position) with the penalties of ``params``.

    Semantics as in vLLM (``vllm/model_executor/layers/utils.py``, ``apply_penalties``) and
    OpenAI's API reference for presence / frequency: with ``n[t]`` the times token t was
    generated so far (prompt tokens excluded), in this order

    * repetition penalty r (CTRL, Keskar et al. 2019; transformers'
      ``RepetitionPenaltyLogitsProcessor``): for every token that occurred in the prompt
      or was generated, ``logit / r`` if ``logit > 0`` else ``logit * r``;
    * ``logit[t] -= frequency_penalty * n[t] + presence_penalty * (n[t] > 0)``.

    Applied to the target's raw logits, before temperature, top-k and top-p, and in greedy
    decoding too (greedy = argmax of the penalised logits).

    Lossless under speculative decoding: row j of a verify block ``[t0, d_1 .. d_{R-1}]``
    predicts the token after ``t0, d_1 .. d_j`` and only counts if ``d_1 .. d_j`` are all
    accepted, so its penalty counts the committed tokens (``counts``, which include
    ``t0``) plus ``d_1 .. d_j``. Each row is then exactly the penalised logits that
    one-token-at-a-time decoding would see at that position, and the acceptance rules run
    unchanged on them: greedy acceptance compares the drafts with the penalised argmax,
    rejection sampling is exact for any proposal q (the drafter's stays unpenalised).

    Only the columns of ``ids`` and ``draft`` can change, so only they are computed (one
    copy of the logits, then O(R * (len(ids) + R)) work, whatever the vocabulary).

    Args:
        logits: ``[R, V]`` (any float dtype): row j predicts the token after ``d_1 .. d_j``.
        counts: float32 ``[V]``: generated tokens committed so far, per token id.
        prompt: bool ``[V]``: tokens of the prompt (only read for a repetition penalty; may
            be None otherwise).
        ids: int64 ``[K]``: every token id that ``counts`` (or, with a repetition penalty,
            ``prompt``) marks, in any order (repeats allowed).
        params: the sampling parameters (their penalties).
        draft: int64 ``[R-1]``, the block's draft tokens ``d_1 .. d_{R-1}``; None: every row
            sees ``counts`` alone.

    Returns:
        float32 ``[R, V]``, a new tensor.
    """
    x = logits.to(torch.float32, copy=True)
    drafts = draft is not None and draft.numel() > 0
    cols = torch.cat([ids, draft]) if drafts else ids  # (a column twice gets the same value twice)
    n = counts[cols].expand(x.shape[0], -1).clone()  # [R, K]
    if drafts:  # row j also counts d_1 .. d_j
        n[1:] += (draft[:, None] == cols[None, :]).float().cumsum(0)
    v = x[:, cols]
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        seen = n > 0 if prompt is None else (n > 0) | prompt[cols]
        # (a tiny or huge r overflows float32: clamped to its finite range, else inf - inf = nan when sampling)
        v = torch.where(seen, torch.where(v > 0, v / r, v * r).clamp(-_F32.max, _F32.max), v)
    if params.frequency_penalty:
        v = v - params.frequency_penalty * n
    if params.presence_penalty:
        v = v - params.presence_penalty * (n > 0)
    x[:, cols] = v
    return x


class Penalties:
    """The token statistics one sequence's penalties need, kept incrementally: counts of
    the generated tokens (float32 ``[V]``), for a repetition penalty the prompt's tokens
    (bool ``[V]``), and the ids of both (int64, each once), on the logits' device. Made
    only for penalised parameters (by :meth:`LogitsProcessor.new`), so unpenalised
    sequences pay nothing."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device: torch.device):
        self.params = params
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.prompt = None
        self._known: set[int] = set()
        if params.repetition_penalty != 1:
            self.prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.prompt[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
            self._known = set(prompt_ids)
        self.ids = torch.tensor(sorted(self._known), dtype=torch.long, device=device)

    def apply(self, logits: torch.Tensor, draft: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`penalize` with this sequence's statistics: ``logits`` ``[R, V]``, ``draft``
        int64 ``[R-1]`` or None -> float32 ``[R, V]``."""
        return penalize(logits, self.counts, self.prompt, self.ids, self.params, draft)

    def commit(self, tokens: list[int]) -> None:
        """Count committed (generated) ``tokens``."""
        dev = self.counts.device
        self.counts.index_put_((torch.tensor(tokens, dtype=torch.long, device=dev),),
                               torch.ones(len(tokens), device=dev), accumulate=True)
        new = [t for t in dict.fromkeys(tokens) if t not in self._known]
        if new:
            self._known.update(new)
            self.ids = torch.cat([self.ids, torch.tensor(new, dtype=torch.long, device=dev)])


class LogitsProcessor:
    """What changes one sequence's target logits before its tokens are chosen, in vLLM's
    order (logits processors, then penalties):

    1. ``logit_bias``: a dense float32 ``[V]`` vector added to every row;
    2. the penalties (:class:`Penalties`, :func:`penalize`);
    3. ``min_tokens``: the logits of ``min_tokens_ids`` set to -inf in the rows that predict
       one of the first ``min_tokens`` generated tokens;
    4. a structured-output grammar (:class:`~dflash_torch.structured.GrammarState`): the
       logits of the tokens it does not allow at a row's position set to -inf (last, so that
       nothing can lift them).

    Lossless under speculative decoding for the same reason as the penalties: row j of a
    verify block predicts generated token ``generated + j`` (``generated`` counts the
    committed tokens) after ``d_1 .. d_j``, so each row gets exactly what
    one-token-at-a-time decoding would apply there. Everything is applied to the verify's
    logits outside the compiled / graphed forwards (new tensors; fixed shapes unchanged).
    Made only for parameters that need it (:meth:`new`): other sequences pay nothing.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device: torch.device):
        self.params = params
        self.bias = None
        if params.logit_bias is not None:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            ids = list(params.logit_bias)
            self.bias[torch.tensor(ids, dtype=torch.long, device=device)] = torch.tensor(
                [params.logit_bias[t] for t in ids], dtype=torch.float32, device=device)
        self.penalties = Penalties(params, prompt_ids, vocab_size, device) if params.penalized else None
        self.held = None  # min_tokens: the ids held back
        if params.min_tokens and params.min_tokens_ids:
            self.held = torch.tensor(sorted(params.min_tokens_ids), dtype=torch.long, device=device)
        self.grammar: GrammarState | None = params.grammar.state(device) if params.grammar is not None else None
        self.generated = 0  # committed tokens

    @classmethod
    def new(cls, params: SamplingParams, prompt_ids: list[int], logits: torch.Tensor) -> "LogitsProcessor | None":
        """The processor of a sequence with ``params`` and ``prompt_ids``, sized for ``logits``
        ``[..., V]`` (any row of the target's); None when nothing processes its logits."""
        return cls(params, prompt_ids, logits.shape[-1], logits.device) if params.processed else None

    def _held_rows(self, rows: int) -> int:
        """How many of the next ``rows`` positions still predict one of the first ``min_tokens`` tokens."""
        return 0 if self.held is None else min(rows, max(0, self.params.min_tokens - self.generated))

    def apply(self, logits: torch.Tensor, draft: torch.Tensor | None = None) -> torch.Tensor:
        """The processed logits of a verify block or of one position: ``logits`` ``[R, V]``
        (row j predicts the token after ``d_1 .. d_j``), ``draft`` int64 ``[R-1]`` (the
        penalties count its tokens) or None -> float32 ``[R, V]``, a new tensor (``logits``
        itself when nothing applies: only min_tokens, already reached)."""
        x = logits.float() + self.bias if self.bias is not None else logits
        if self.penalties is not None:
            x = self.penalties.apply(x, draft)
        held = self._held_rows(x.shape[0])
        if held:
            if x is logits:
                x = logits.to(torch.float32, copy=True)
            x[:held, self.held] = float("-inf")
        if self.grammar is not None:  # row j: after the committed tokens and d_1 .. d_j
            drafts = [] if draft is None else draft.tolist()
            if self.params.greedy:  # (masks only where they change the argmax: GrammarState.mask_greedy)
                x = self.grammar.mask_greedy(x.float(), drafts)
            else:
                x = x.float().masked_fill(~self.grammar.masks(drafts), float("-inf"))
        return x

    @property
    def draft_limit(self) -> int | None:
        """How many drafts of the block :meth:`apply` last processed may be accepted (None:
        all): a draft that leads into a dead end of the constraint ends the round
        (:attr:`~dflash_torch.structured.GrammarState.draft_limit`)."""
        return self.grammar.draft_limit if self.grammar is not None else None

    @property
    def error(self) -> str | None:
        """Why this sequence cannot go on (its grammar failed: see
        :attr:`~dflash_torch.structured.GrammarState.failed`), else None."""
        return self.grammar.failed if self.grammar is not None else None

    @property
    def complete_after(self) -> int | None:
        """How many of the last committed tokens lead to where the grammar is complete and
        allows only an EOS (:attr:`~dflash_torch.structured.GrammarState.complete_after`),
        else None (also without a grammar)."""
        return self.grammar.complete_after if self.grammar is not None else None

    @property
    def adjusts_drafts(self) -> bool:
        """Whether :meth:`choose_draft` proposes other drafts than the drafter alone would
        (a bias, min_tokens not reached yet, a grammar)."""
        return self.bias is not None or self._held_rows(1) > 0 or self.grammar is not None

    def choose_draft(self, drafter, scores, params: SamplingParams, generator: torch.Generator | None):
        """The draft of one block from the drafter's ``scores`` (see :meth:`draft_scores`):
        ``drafter.choose_draft`` on the biased / masked scores, guided by the grammar if any
        (each slot chosen among the tokens it allows after the drafts before it; see
        :mod:`dflash_torch.structured`). Returns ``(tokens int64 [B-1], q or None)`` as
        ``drafter.choose_draft`` does."""
        return drafter.choose_draft(self.draft_scores(scores), params, generator, guide=self.grammar)

    def draft_scores(self, scores):
        """The drafter's scores with the logit bias and the min_tokens mask (no penalties):
        the drafter then proposes no banned token, which the target would reject. Any
        proposal keeps decoding lossless (the acceptance rules below decide on the target's scores).

        ``scores``: the draft logits ``[B-1, V]`` (row r predicts the same generated token as
        verify row r; the held ids get -inf), or a DFlash 2 lattice ``(ids [B-1, K], edges
        [B-1, K, K])``, whose edges into each candidate get that candidate's bias (held ids:
        minus float32's largest value, finite, as every candidate of a slot may be held).
        Returns the same kind, float32 (``scores`` itself when nothing applies)."""
        held = self._held_rows(len(scores[0]) if isinstance(scores, tuple) else scores.shape[0])
        if self.bias is None and not held:
            return scores
        if isinstance(scores, tuple):
            ids, edges = scores
            add = self.bias[ids] if self.bias is not None else torch.zeros(ids.shape, device=ids.device)
            if held:
                add[:held] -= torch.isin(ids[:held], self.held) * _F32.max
            return ids, edges.float() + add[..., None, :]
        x = scores.float() + self.bias if self.bias is not None else scores.to(torch.float32, copy=True)
        if held:
            x[:held, self.held] = float("-inf")
        return x

    def commit(self, tokens: list[int]) -> None:
        """Count committed (generated) ``tokens`` (and move the grammar past them)."""
        self.generated += len(tokens)
        if self.penalties is not None:
            self.penalties.commit(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` ``[N, V]`` -> int64 ``[N]``."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax of each row of ``logits`` ``[N, V]`` -> int64 ``[N]`` (the first index of
    the maximum, as ``torch.argmax``). Computed in float32: the upcast is exact, and on
    CPU a bfloat16 argmax is about 3x slower than upcast plus float32 argmax."""
    return logits.float().argmax(dim=-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token for each row of ``logits`` ``[N, V]`` -> int64 ``[N]``."""
    if params.greedy:
        return greedy_tokens(logits)
    return sample(probabilities(logits, params), generator)


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor,
                  limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance, on the device (no host sync), of one block or of a batch of
    blocks (any leading dimensions ``...``).

    Args:
        draft: int64 ``[..., B-1]`` draft tokens for positions ``s+1 .. s+B-1``.
        target_logits: ``[..., B, V]`` target logits of the verify block (row j predicts ``s+j+1``).
        limit: at most this many drafts are accepted (None: all): the block is decided as
            one of ``limit`` drafts (a structured output's dead end, :attr:`LogitsProcessor.draft_limit`).

    Returns:
        int64 tensors ``(a, token)`` of shape ``[...]`` (0-dim for one block): a accepted
        draft tokens (0 <= a <= B-1) and the target's token for position ``s+a+1``.
    """
    choice = greedy_tokens(target_logits)
    a = (draft == choice[..., :-1]).int().cumprod(-1).sum(-1)
    if limit is not None:
        a = a.clamp_max(limit)
    return a, choice.gather(-1, a[..., None])[..., 0]


def accept_sampling(
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (lossless), on the device (no host sync).

    Args:
        draft: int64 ``[B-1]``, drawn from ``draft_probs``.
        draft_probs: float32 ``[B-1, V]`` drafter distributions q.
        target_probs: float32 ``[B, V]`` target distributions p (row j for position ``s+j+1``).
        limit: at most this many drafts are accepted (None: all): where draft ``limit``
            (0-based: the one after them) passes its test, it is the round's last token
            instead of an accepted draft (no token is chosen after it: a structured
            output's dead end, :attr:`LogitsProcessor.draft_limit`); row ``limit``'s token
            is then distributed as p, as every row's is.

    Returns:
        0-dim int64 tensors ``(a, token)`` as in :func:`accept_greedy`. One candidate
        token is drawn per row from ``normalize(max(p - q, 0))`` (``p_B`` for the last
        row, where q is 0) and the one at row ``a`` is kept; those draws are independent
        of the acceptance draws, so the result is exactly distributed as the target's.
    """
    n = draft.shape[0]
    rows = torch.arange(n, device=draft.device)
    p_d = target_probs[rows, draft]
    q_d = draft_probs[rows, draft]
    u = torch.rand(n, generator=generator, device=draft.device)
    a = (u * q_d < p_d).int().cumprod(0).sum()
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:1])], dim=0)
    residual = (target_probs - q_pad).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs)
    candidates = sample(residual, generator)
    if limit is not None:  # (draft `limit` accepted: it ends the round)
        return a.clamp_max(limit), torch.where(a > limit, draft[limit], candidates[a.clamp_max(limit)])
    return a, candidates[a]


def first_token(last: torch.Tensor, prompt: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, LogitsProcessor | None]:
    """A sequence's first token (0-dim int64), chosen after its prefill from its prompt's
    last logits ``[V]`` (left as they are), and its :class:`LogitsProcessor` (None when
    nothing processes its logits), which counts it."""
    processor = LogitsProcessor.new(params, prompt, last)
    logits = last[None] if processor is None else processor.apply(last[None])
    token = choose(logits, params, generator)[0]
    if processor is not None:
        processor.commit([int(token)])
    return token, processor


def first_logprobs(last: torch.Tensor, first: int, params: SamplingParams) -> list[TokenLogprob] | None:
    """The prefill round's logprobs: of its token ``first`` from the prompt's last logits
    ``[V]`` (None when ``params`` asks for none)."""
    return None if params.logprobs is None else token_logprobs(last[None], [first], params.logprobs)
