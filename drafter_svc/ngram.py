"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence
of the sequence's last n tokens (no model; Saxena 2023, "Prompt Lookup Decoding").

The proposal is deterministic, so its draft distribution q is a point mass on each
proposed token: the verifier accepts token x with probability p(x) and otherwise draws
from norm(max(0, p − q)), which keeps sampling lossless. A call may propose fewer than
the asked k tokens, or none when nothing matches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from services.kv_cache import SessionCaches
from services.messages import DraftCall, DraftResult, ReplicaStats
from services.model_runner import check_delta, check_num_tokens
from services.models import ModelMeta


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix n-gram
    (n from max_n down to min_n); [] when no suffix of length >= min_n recurs."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n:])
        for start in range(size - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n: start + n + k])
    return []


class NgramDrafterEngine:
    kind = "ngram"

    def __init__(self, meta: ModelMeta, caches: SessionCaches, max_draft_tokens: int,
                 min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")
        self.meta = meta
        self.caches = caches
        self.max_draft_tokens = max_draft_tokens
        self.min_n, self.max_n = min_n, max_n
        self.stats = ReplicaStats()
        self.queue_depth = 0

    def close(self) -> None:
        pass

    async def release(self, session_id: str) -> bool:
        """Frees the session's token list (Release)."""
        return self.caches.release(session_id)

    async def draft(self, call: DraftCall) -> DraftResult:
        self.stats.calls += 1
        delta = call.cache
        check_num_tokens(call.num_tokens, self.max_draft_tokens)
        check_delta(self.meta, delta.session_id, delta.base_len, delta.new_tokens,
                    call.num_tokens - 1)
        start = time.perf_counter()
        with self.caches.checkout(delta.session_id, delta.base_len, delta.base_hash) as entry:
            entry.tokens.extend(delta.new_tokens)
            drafts = propose(entry.tokens, call.num_tokens, self.min_n, self.max_n)
            self.stats.fed_tokens += len(delta.new_tokens)
            self.stats.draft_tokens += len(drafts)
            return DraftResult(token_ids=tuple(drafts), q_ids=tuple((t,) for t in drafts),
                               q_probs=tuple((1.0,) for _ in drafts),
                               cached_len=len(entry.tokens), cache_hit=delta.base_len > 0,
                               compute_ms=(time.perf_counter() - start) * 1000.0)
