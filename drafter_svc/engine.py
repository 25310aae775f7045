"""The model drafter: proposes k tokens from a small causal LM with a per-session cache.

The cache is advanced incrementally (only new committed tokens and the drafts
are fed, never the whole prefix) and rolled back by the hash-checked handle of
the next call. Each draft token is sampled from a sparse q: the top
``max_support`` tokens of the warped distribution, renormalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from drafter_svc.tree import draft_tree
from services.batching import FeedJob, Row
from services.errors import InvalidArgument
from services.kv_cache import SessionCache
from services.messages import DraftCall, DraftResult, SpeculateCall, SpeculateResult
from services.model_runner import ModelEngine, SoloJob, check_delta, check_num_tokens
from services.sampling import SamplingParams, sparse_draft_sample_rows, warp_logits


def check_draft_params(params: SamplingParams, max_support: int) -> None:
    if not 1 <= max_support <= 256:
        raise InvalidArgument(f"max_support must be in 1..256, got {max_support}")
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def check_speculate(call: SpeculateCall, max_draft_tokens: int) -> None:
    """What Speculate needs beyond a Draft's checks (the engine's and the n-gram drafter's)."""
    check_num_tokens(call.num_tokens, max_draft_tokens)
    check_draft_params(call.params, call.max_support)
    if not 1 <= call.num_drafts <= max_draft_tokens:
        raise InvalidArgument(f"num_drafts must be in 1..{max_draft_tokens}, got {call.num_drafts}")
    if len(call.cache.new_tokens) < call.num_drafts + 1:
        raise InvalidArgument(
            f"new_tokens must hold the last committed token and the {call.num_drafts} drafts "
            f"(at least {call.num_drafts + 1} tokens), got {len(call.cache.new_tokens)}")
    if not 1 <= call.max_branches <= 64:
        raise InvalidArgument(f"max_branches must be in 1..64, got {call.max_branches}")
    for name, value in (("acceptance", call.acceptance), ("coverage", call.coverage)):
        if not 0.0 <= value <= 1.0:
            raise InvalidArgument(f"{name} must be in [0, 1], got {value}")


class DrafterEngine(ModelEngine):

    async def draft(self, call: DraftCall) -> DraftResult:
        return await self.run_one(call, self._begin, self._finish)

    async def draft_many(self, calls: Sequence[DraftCall]) -> list[DraftResult | Exception]:
        """Each call's drafts, or the error it alone fails with; the calls that pass
        validation run their k steps together (ModelEngine.run_many)."""
        return await self.run_many(calls, self._begin, self._finish)

    def _begin(self, call: DraftCall) -> tuple[AbstractContextManager, _DraftJob]:
        delta = call.cache
        check_num_tokens(call.num_tokens, self.max_draft_tokens)
        check_draft_params(call.params, call.max_support)
        check_delta(self.runner.meta, delta.session_id, delta.base_len, delta.new_tokens,
                    call.num_tokens - 1)
        generator = torch.Generator().manual_seed(call.seed)
        return self.checked_out(delta, lambda entry, fed: _DraftJob(
            entry, fed, self.prefill_chunk, call, generator))

    def _finish(self, call: DraftCall, job: _DraftJob, answer) -> DraftResult:
        drafts, ms, batch = answer
        self.stats.fed_tokens += job.feeds
        self.stats.draft_tokens += len(drafts)
        return DraftResult(
            token_ids=tuple(t for t, _, _ in drafts),
            q_ids=tuple(tuple(ids) for _, ids, _ in drafts),
            q_probs=tuple(tuple(q) for _, _, q in drafts),
            cached_len=len(job.entry.tokens), cache_hit=call.cache.base_len > 0, compute_ms=ms,
            batch_size=batch)

    async def speculate(self, call: SpeculateCall) -> SpeculateResult:
        """The next round's drafts for the likely outcomes of this round's verify
        (drafter_svc/tree.py), in one call that runs while the verifier works."""
        self.stats.calls += 1
        delta = call.cache
        check_speculate(call, self.max_draft_tokens)
        check_delta(self.runner.meta, delta.session_id, delta.base_len, delta.new_tokens,
                    call.num_tokens + 1)
        committed = len(delta.new_tokens) - call.num_drafts  # the rest are this round's drafts
        with self.caches.checkout(delta.session_id, delta.base_len, delta.base_hash,
                                  delta.new_tokens, committed) as entry:
            fed = entry.unfed(delta.base_len, delta.new_tokens)
            job = SoloJob(lambda model, device: draft_tree(model, entry, fed, call, device),
                          passes=1 + call.num_tokens)
            (branches, _), ms, batch = await self.runner.submit(job)
            self.stats.fed_tokens += len(fed)
            self.stats.draft_tokens += sum(len(b.draft.token_ids) for b in branches)
            return SpeculateResult(branches=branches, cached_len=len(entry.tokens),
                                   cache_hit=delta.base_len > 0, compute_ms=ms, batch_size=batch)


class _DraftJob(FeedJob):
    """num_tokens passes (after the chunks of a long prompt): the pending tokens, then each
    sampled draft token in turn."""

    def __init__(self, entry: SessionCache, pending: list[int], chunk: int, call: DraftCall,
                 generator: torch.Generator) -> None:
        super().__init__(entry, pending, chunk)
        self.call, self.generator = call, generator
        self.out: list[tuple[int, list[int], list[float]]] = []

    @property
    def done(self) -> bool:
        return len(self.out) >= self.call.num_tokens

    def row(self) -> Row:
        return self.row_of(self.pending, keep=1)

    def use(self, logits: torch.Tensor) -> None:  # logits [1, V]
        self.entry.tokens.extend(self.pending)
        greedy = self.call.params.greedy
        probs = logits if greedy else warp_logits(logits, self.call.params)  # [1, V]
        # The same sampler as a branch of the speculation cache (drafter_svc/tree.py), so a
        # seeded request draws the same drafts whichever path drafted them.
        draw = sparse_draft_sample_rows(probs, self.call.max_support, [self.generator],
                                        greedy)[0]
        self.out.append(draw)
        self.pending = [draw[0]]

    def result(self) -> list[tuple[int, list[int], list[float]]]:
        return self.out
