"""The speculative decoding loop: prefill, then rounds of propose, verify, accept,
rollback and inject (DESIGN.md, "One decoding round").

:class:`SpeculativeDecoder` yields the tokens committed by each round; stopping
(EOS, stop strings, max_new_tokens) is the caller's job (see ``engine.py``), which
closes the iterator when it is done. Without a drafter (or with block size 1) the
same loop is plain autoregressive target-only decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import DFlashError
from .models.drafter import DFlashDrafter, InjectedContext, RecomputedContext
from .models.target import TargetModel
from .sampling import SamplingParams, accept_greedy, accept_sampling, choose, probabilities, sample

DRAFT_MODES = ("inject", "recompute")


@dataclass
class Round:
    """What one step of the loop committed.

    Attributes:
        tokens: committed token ids, in order (the prefill step commits one token;
            a decoding round commits tau = accepted + 1 tokens).
        acceptance_length: tau of a decoding round, None for the prefill step.
        propose_time: seconds spent drafting (0 without a drafter).
        verify_time: seconds of the target forward (the prefill time for the prefill step).
        total_time: seconds of the whole step.
    """

    tokens: list[int]
    acceptance_length: int | None
    propose_time: float
    verify_time: float
    total_time: float


class SpeculativeDecoder:
    """DFlash speculative decoding for one sequence at a time.

    Args:
        target: the target model.
        drafter: a DFlash drafter, or None for target-only decoding.
        block_size: tokens per block B (default: the drafter's); at most the drafter's.
        draft_mode: ``"inject"`` (persistent drafter KV cache) or ``"recompute"``.
        prefill_chunk: prompt tokens per prefill forward.

    Raises:
        DFlashError: invalid block size or draft mode.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        block_size: int | None = None,
        draft_mode: str = "inject",
        prefill_chunk: int = 512,
    ):
        if draft_mode not in DRAFT_MODES:
            raise DFlashError(f"draft mode must be one of {', '.join(DRAFT_MODES)}, got {draft_mode!r}")
        self.target, self.drafter, self.draft_mode = target, drafter, draft_mode
        if drafter is None:
            if block_size not in (None, 1):
                raise DFlashError("a block size needs a drafter (target-only decoding commits one token per step)")
            block_size = 1
        else:
            trained = drafter.config.block_size
            block_size = trained if block_size is None else block_size
            if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= trained:
                raise DFlashError(f"block size must be an integer in [1, {trained}] (the drafter's trained block size), got {block_size!r}")
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.target_cache = target.new_cache()
        self.feature_layers = drafter.config.target_layer_ids if drafter is not None and block_size > 1 else None
        if self.feature_layers is None:
            self.context = None
        elif draft_mode == "inject":
            self.context = InjectedContext(drafter)
        else:
            self.context = RecomputedContext(drafter)
        self.device = target.model.embed_tokens.weight.device

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + generated tokens) the target supports."""
        return self.target.config.max_position_embeddings

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def rounds(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int) -> Iterator[Round]:
        """Decode until ``max_new_tokens`` tokens have been committed (or the caller stops).

        Args:
            prompt_ids: the prompt's token ids (at least one).
            params: sampling parameters (validated).
            max_new_tokens: upper bound of committed tokens; the last round may commit
                more than needed and the caller cuts.

        Yields:
            one :class:`Round` for the prefill, then one per decoding round.

        Raises:
            DFlashError: empty prompt, token ids outside the vocabulary, or a prompt plus
                ``max_new_tokens`` longer than the target's context.
        """
        n_prompt = len(prompt_ids)
        vocab = self.target.config.vocab_size
        if n_prompt == 0:
            raise DFlashError("the prompt is empty (0 tokens)")
        if any(not 0 <= int(t) < vocab for t in prompt_ids):
            raise DFlashError(f"prompt token ids must be in [0, {vocab})")
        if n_prompt + max_new_tokens > self.max_context:
            raise DFlashError(
                f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's context of {self.max_context} tokens"
            )
        B = self.block_size
        capacity = n_prompt + max_new_tokens + B + 1
        self.target_cache.reset(capacity)
        if self.context is not None:
            self.context.reset(capacity)
        generator = params.generator(self.device)
        dev = self.device
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=dev)

        # prefill: the target reads the prompt in chunks; every row's features are injected
        t0 = time.perf_counter()
        for c0 in range(0, n_prompt, self.prefill_chunk):
            c1 = min(c0 + self.prefill_chunk, n_prompt)
            positions = torch.arange(c0, c1, device=dev)
            logits, feats = self.target(ids[c0:c1], positions, self.target_cache, c1, self.feature_layers, logits_from=c1 - c0 - 1)
            if self.context is not None:
                self.context.inject(self.drafter, feats, positions, c1 - c0)
        self.target_cache.length = n_prompt
        token = int(choose(logits[-1:], params, generator)[0])
        self._sync()
        t1 = time.perf_counter()
        yield Round([token], None, 0.0, t1 - t0, t1 - t0)

        s, committed = n_prompt, 1
        mask_id = self.drafter.config.mask_token_id if self.drafter is not None else 0
        while committed < max_new_tokens:
            t0 = time.perf_counter()
            positions = torch.arange(s, s + B, device=dev)
            block = torch.full((B,), mask_id, dtype=torch.long, device=dev)
            block[0] = token
            draft_probs = None
            if B > 1:
                hidden = self.drafter(self.target.embed(block), positions, self.context)
                draft_logits = self.target.logits(hidden[1:])
                if params.greedy:
                    block[1:] = draft_logits.argmax(dim=-1)
                else:
                    draft_probs = probabilities(draft_logits, params)
                    block[1:] = sample(draft_probs, generator)
            self._sync()
            t1 = time.perf_counter()
            logits, feats = self.target(block, positions, self.target_cache, s + B, self.feature_layers)
            if B == 1:
                a, bonus = 0, int(choose(logits, params, generator)[0])
            elif params.greedy:
                a, bonus = accept_greedy(block[1:], logits)
            else:
                a, bonus = accept_sampling(block[1:], draft_probs, probabilities(logits, params), generator)
            t2 = time.perf_counter()
            tokens = block[1:a + 1].tolist() + [bonus]
            self.target_cache.length = s + a + 1  # rollback: rows past the accepted prefix are stale
            if self.context is not None:
                self.context.inject(self.drafter, feats[:a + 1], positions[:a + 1], a + 1)
            self._sync()
            t3 = time.perf_counter()
            s += a + 1
            committed += a + 1
            token = bonus
            yield Round(tokens, a + 1, t1 - t0, t2 - t1, t3 - t0)
