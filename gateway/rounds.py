"""One round of speculative decoding, as the gateway runs it.

Per round (Leviathan et al. 2023): a drafter proposes k tokens with their sparse
q; the verifier scores them in one forward pass and returns how many it
accepted plus one token of its own. Caches are addressed by deltas: each call
names the prefix the replica is assumed to hold (length + hash) and sends only
the rest; a replica that lost the cache asks for a resync and gets the whole
prefix; a replica that fails is marked down and another one takes over.

Pipelined drafting: while the verifier checks round r's drafts d1..dk, the drafter
already continues from d1..dk as if all were accepted: its first token is its guess g of
the verifier's extra token, the next ones are round r+1's drafts. When the verifier
accepts all k and its extra token is g, round r+1 starts verifying at once, with no draft
call on its critical path; otherwise the prepared drafts are dropped. Drafts are used
only when the prefix they were drawn from is exactly the committed one, so they are
distributed as fresh drafts would be and the output stays lossless.
"""

from __future__ import annotations

import asyncio
import dataclasses
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


def _trim(draft: DraftResult, k: int) -> DraftResult:
    """The first k drafts (k may have shrunk since they were prepared)."""
    if len(draft.token_ids) <= k:
        return draft
    return dataclasses.replace(draft, token_ids=draft.token_ids[:k], q_ids=draft.q_ids[:k],
                               q_probs=draft.q_probs[:k])


def _delta(session_id: str, tokens: list[int], base: int) -> CacheDelta:
    return CacheDelta(session_id=session_id, base_len=base, base_hash=token_hash(tokens[:base]),
                      new_tokens=tuple(tokens[base:]))


@dataclass(frozen=True)
class Prefetch:
    """Drafts prepared during the previous round's verify (see the module docstring)."""

    base: int  # committed tokens when they were prepared
    assumed: tuple[int, ...]  # what they assume is committed next: the drafts + the guess
    draft: DraftResult  # the next round's drafts; its cached_len counts committed + assumed


@dataclass(frozen=True)
class RoundResult:
    drafted: tuple[int, ...]
    drafter_tail: tuple[int, ...] | None  # what the drafter holds past the old tokens (None:
    #                                       no drafter call involved this round)
    num_accepted: int
    extra_token: int
    draft_ms: float  # wall time of the draft call on the round's critical path (0: none)
    verify_ms: float
    draft_compute_ms: float  # its model compute (0 when the drafts were prefetched)
    verify_compute_ms: float
    pipeline: str = ""  # "used", "dropped" or "none" (nothing prepared); "" without drafts
    warm: bool = True  # both calls found their caches (no prefill or resync in the timings)
    prefetch: Prefetch | None = None  # drafts for the next round, if prepared

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
                  round_index: int, deadline: Callable[[], float | None],
                  prefetch: Prefetch | None = None) -> RoundResult:
        """Drafts up to k tokens with a drafter of ``kind`` (k = 0: none), or takes them
        from ``prefetch`` when its assumption held, and verifies them for session ``h``;
        with pipelining on, prepares the next round's drafts meanwhile. Updates the
        handle's replica fields (who holds the caches) but not its tokens."""
        old = len(h.tokens)
        start = time.perf_counter()
        draft, cached, outcome = None, 0, ""
        if k:
            outcome = "none"
            if prefetch is not None:
                outcome = "dropped"
                if (prefetch.base + len(prefetch.assumed) == old
                        and tuple(h.tokens[prefetch.base:]) == prefetch.assumed):
                    outcome = "used"
                    draft, cached = _trim(prefetch.draft, k), prefetch.draft.cached_len
            if draft is None:
                draft = await self._draft(h, params, k, kind,
                                          round_seed(seed, round_index, "draft"), deadline)
                cached = draft.cached_len if draft is not None else 0
        mid = time.perf_counter()
        drafted = draft if draft is not None and draft.token_ids else None
        verify = self._verify(h, params, drafted, round_seed(seed, round_index, "verify"),
                              deadline)
        ahead = None
        if drafted is not None and self.config.pipeline and h.drafter:
            ahead = asyncio.ensure_future(self._draft_ahead(
                h, params, drafted, cached, k, round_seed(seed, round_index + 1, "draft"),
                deadline))
        try:
            result = await verify
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
        verified = time.perf_counter()
        next_draft = await ahead if ahead is not None else None
        fresh = outcome != "used"
        tail = None
        if drafted is not None:
            ext = list(drafted.token_ids)
            if next_draft is not None:  # it fed the drafts and its guess, then drafted on
                ext = [*next_draft.assumed, *next_draft.draft.token_ids]
                cached = next_draft.draft.cached_len
            tail = tuple(ext[: max(0, cached - old)])
        elif draft is not None:
            tail = ()
        return RoundResult(
            drafted=drafted.token_ids if drafted else (), drafter_tail=tail,
            num_accepted=result.num_accepted, extra_token=result.extra_token,
            draft_ms=(mid - start) * 1000 if draft is not None and fresh else 0.0,
            verify_ms=(verified - mid) * 1000,
            draft_compute_ms=draft.compute_ms if draft is not None and fresh else 0.0,
            verify_compute_ms=result.compute_ms, pipeline=outcome, prefetch=next_draft,
            warm=result.cache_hit and (draft is None or not fresh or draft.cache_hit))

    async def _draft_ahead(self, h: SessionHandle, params: SamplingParams, draft: DraftResult,
                           cached: int, k: int, seed: int, deadline) -> Prefetch | None:
        """Round r+1's drafts, assuming all of ``draft`` is accepted: one call to the drafter
        that holds the session, for 1 + k tokens (the guess of the extra token, then k).
        Any failure just means nothing is prepared: the next round drafts as usual."""
        replica = self.drafters.replicas.get(h.drafter)
        if replica is None or replica.info is None or k + 1 > replica.info.max_draft_tokens:
            return None
        ext = list(h.tokens) + list(draft.token_ids)
        base = min(cached, len(ext) - 1)
        try:
            result = await clients.draft(replica, DraftCall(
                cache=_delta(h.session_id, ext, base), num_tokens=k + 1, params=params,
                seed=seed, max_support=self.config.max_support), self._timeout(deadline))
        except Exception as exc:  # noqa: BLE001 - optional work: any failure = not prepared
            log.info("no pipelined draft for session %s: %s", h.session_id, exc)
            return None
        if len(result.token_ids) < 2:
            return None
        guess = result.token_ids[0]
        return Prefetch(base=len(h.tokens), assumed=(*draft.token_ids, guess),
                        draft=dataclasses.replace(result, token_ids=result.token_ids[1:],
                                                  q_ids=result.q_ids[1:],
                                                  q_probs=result.q_probs[1:]))

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
