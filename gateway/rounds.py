"""One round of speculative decoding, as the gateway runs it.

Per round (Leviathan et al. 2023): a drafter proposes k tokens with their sparse
q; the verifier scores them in one forward pass and returns how many it
accepted plus one token of its own. Caches are addressed by deltas: each call
names the prefix the replica is assumed to hold (length + hash) and sends only
the rest; a replica that lost the cache asks for a resync and gets the whole
prefix; a replica that fails is marked down and another one takes over.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway import clients
from gateway.clients import ReplicaFailed
from gateway.replicas import ReplicaPool
from services.config import GatewayConfig
from services.errors import DeadlineExceeded, ResyncRequired, Unavailable
from services.hashing import token_hash
from services.messages import CacheDelta, DraftCall, DraftResult, VerifyCall, VerifyResult
from services.sampling import SamplingParams
from services.session_store import SessionHandle

log = logging.getLogger(__name__)


def round_seed(seed: int, round_index: int, role: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{round_index}:{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _delta(session_id: str, tokens: list[int], base: int) -> CacheDelta:
    return CacheDelta(session_id=session_id, base_len=base, base_hash=token_hash(tokens[:base]),
                      new_tokens=tuple(tokens[base:]))


@dataclass(frozen=True)
class RoundResult:
    drafted: tuple[int, ...]
    drafter_cached: int  # tokens the drafter's cache holds after the call (0: no call)
    num_accepted: int
    extra_token: int
    draft_ms: float  # wall time of the draft call(s), 0 without drafts
    verify_ms: float
    draft_compute_ms: float
    verify_compute_ms: float

    @property
    def proposed(self) -> list[int]:
        """The tokens this round yields: the accepted drafts, then the verifier's own token."""
        return list(self.drafted[: self.num_accepted]) + [self.extra_token]


class RoundRunner:
    def __init__(self, config: GatewayConfig, drafters: ReplicaPool,
                 verifiers: ReplicaPool) -> None:
        self.config = config
        self.drafters = drafters
        self.verifiers = verifiers

    async def run(self, h: SessionHandle, params: SamplingParams, k: int, kind: str, seed: int,
                  round_index: int, deadline: Callable[[], float | None]) -> RoundResult:
        """Drafts up to k tokens with a drafter of ``kind`` (k = 0: none) and verifies them
        for session ``h``; updates the handle's replica fields (who holds the caches) but
        not its tokens."""
        start = time.perf_counter()
        draft = None
        if k:
            draft = await self._draft(h, params, k, kind,
                                      round_seed(seed, round_index, "draft"), deadline)
        mid = time.perf_counter()
        drafted = draft if draft is not None and draft.token_ids else None
        result = await self._verify(h, params, drafted,
                                    round_seed(seed, round_index, "verify"), deadline)
        end = time.perf_counter()
        return RoundResult(
            drafted=draft.token_ids if draft else (),
            drafter_cached=draft.cached_len if draft else 0, num_accepted=result.num_accepted,
            extra_token=result.extra_token, draft_ms=(mid - start) * 1000 if draft else 0.0,
            verify_ms=(end - mid) * 1000,
            draft_compute_ms=draft.compute_ms if draft else 0.0,
            verify_compute_ms=result.compute_ms)

    def _timeout(self, deadline: Callable[[], float | None]) -> float:
        remaining = deadline()
        if remaining is None:
            return self.config.rpc_timeout_s
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed before it finished")
        return min(self.config.rpc_timeout_s, remaining)

    async def _on_replica(self, h: SessionHandle, pool: ReplicaPool, role: str, call,
                          kind: str = ""):
        """Runs ``call(replica, base_len)`` on the replica holding the session's cache (role
        "drafter" or "verifier"), resyncing from base 0 when asked; a failed replica is marked
        down and the next one tried from scratch. None when no replica could answer."""
        holder, valid = getattr(h, role), getattr(h, f"{role}_len")
        tried: set[str] = set()
        while (replica := pool.pick(holder, frozenset(tried), kind)) is not None:
            base = min(valid, len(h.tokens) - 1) if replica.address == holder else 0
            try:
                try:
                    result = await call(replica, base)
                except ResyncRequired:
                    result = await call(replica, 0)
            except (ReplicaFailed, ResyncRequired) as exc:
                log.warning("%s %s failed for session %s (%s); trying another", role,
                            replica.address, h.session_id, exc)
                pool.mark_down(replica)
                tried.add(replica.address)
                continue
            pool.mark_ok(replica)
            setattr(h, role, replica.address)
            return result
        return None

    async def _draft(self, h: SessionHandle, params: SamplingParams, k: int, kind: str,
                     seed: int, deadline) -> DraftResult | None:
        """Drafts k tokens; None (no drafter could answer) runs the round with k = 0."""

        async def call(replica, base: int) -> DraftResult:
            delta = _delta(h.session_id, h.tokens, base)
            return await clients.draft(replica, DraftCall(
                cache=delta, num_tokens=k, params=params, seed=seed,
                max_support=self.config.max_support), self._timeout(deadline))

        result = await self._on_replica(h, self.drafters, "drafter", call, kind)
        if result is None:
            log.warning("no drafter reachable: session %s runs this round without drafts",
                        h.session_id)
            h.drafter, h.drafter_len = "", 0
        return result

    async def _verify(self, h: SessionHandle, params: SamplingParams,
                      draft: DraftResult | None, seed: int, deadline) -> VerifyResult:
        sparse = draft is not None and not params.greedy

        async def call(replica, base: int) -> VerifyResult:
            return await clients.verify(replica, VerifyCall(
                cache=_delta(h.session_id, h.tokens, base),
                draft_ids=draft.token_ids if draft else (),
                q_ids=draft.q_ids if sparse else (), q_probs=draft.q_probs if sparse else (),
                params=params, seed=seed), self._timeout(deadline))

        result = await self._on_replica(h, self.verifiers, "verifier", call)
        if result is None:
            raise Unavailable(f"no verifier replica could serve the request (of "
                              f"{len(self.verifiers)} configured): retry later")
        return result
