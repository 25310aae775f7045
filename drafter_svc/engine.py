"""The model drafter: proposes k tokens from a small causal LM with a per-session cache.

The cache is advanced incrementally (only new committed tokens and the drafts
are fed, never the whole prefix) and rolled back by the hash-checked handle of
the next call. Each draft token is sampled from a sparse q: the top
``max_support`` tokens of the warped distribution, renormalised.
"""

from __future__ import annotations

import torch

from services.batching import Row, StepJob
from services.errors import InvalidArgument
from services.kv_cache import SessionCache
from services.messages import DraftCall, DraftResult
from services.model_runner import ModelEngine, check_delta, check_num_tokens
from services.sampling import sparse_draft_sample, warp_logits


class DrafterEngine(ModelEngine):

    async def draft(self, call: DraftCall) -> DraftResult:
        self.stats.calls += 1
        delta = call.cache
        check_num_tokens(call.num_tokens, self.max_draft_tokens)
        if not 1 <= call.max_support <= 256:
            raise InvalidArgument(f"max_support must be in 1..256, got {call.max_support}")
        try:
            call.params.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        check_delta(self.runner.meta, delta.session_id, delta.base_len, delta.new_tokens,
                    call.num_tokens - 1)
        generator = torch.Generator().manual_seed(call.seed)

        with self.caches.checkout(delta.session_id, delta.base_len, delta.base_hash) as entry:
            job = _DraftJob(entry, list(delta.new_tokens), call, generator)
            drafts, ms, batch = await self.runner.submit(job)
            self.stats.fed_tokens += len(delta.new_tokens)
            self.stats.draft_tokens += len(drafts)
            return DraftResult(
                token_ids=tuple(t for t, _, _ in drafts),
                q_ids=tuple(tuple(ids) for _, ids, _ in drafts),
                q_probs=tuple(tuple(q) for _, _, q in drafts),
                cached_len=len(entry.tokens), cache_hit=delta.base_len > 0, compute_ms=ms,
                batch_size=batch)


class _DraftJob(StepJob):
    """num_tokens passes: the pending tokens, then each sampled draft token in turn."""

    def __init__(self, entry: SessionCache, pending: list[int], call: DraftCall,
                 generator: torch.Generator) -> None:
        self.entry, self.pending, self.call, self.generator = entry, pending, call, generator
        self.out: list[tuple[int, list[int], list[float]]] = []

    @property
    def done(self) -> bool:
        return len(self.out) >= self.call.num_tokens

    def next_row(self) -> Row:
        return Row(tokens=self.pending, kv=self.entry.kv, start=len(self.entry.tokens), keep=1)

    def take(self, logits: torch.Tensor) -> None:  # logits [1, V]
        self.entry.tokens.extend(self.pending)
        probs = warp_logits(logits[0], self.call.params)  # [V]
        token, ids, q = sparse_draft_sample(probs, self.call.max_support, self.generator)
        self.out.append((token, ids.tolist(), q.tolist()))
        self.pending = [token]

    def result(self) -> list[tuple[int, list[int], list[float]]]:
        return self.out
