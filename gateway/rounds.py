"""One round of speculative decoding, as the gateway runs it.

Per round (Leviathan et al. 2023): a drafter proposes k tokens with their sparse
q; the verifier scores them in one forward pass and returns how many it
accepted plus one token of its own. Caches are addressed by deltas: each call
names the prefix the replica is assumed to hold (length + hash) and sends only
the rest; a replica that lost the cache asks for a resync and gets the whole
prefix; a replica that fails is marked down and another one takes over.

The speculation cache (``--pipeline``): while the verifier checks round r's drafts
d1..dk, the drafter that holds the session drafts round r+1 for the likely outcomes of
that verify, each accept length j with guesses of the verifier's own token t after it, as
one batched call over that tree (Speculate; services/speculation.py says which outcomes).
When the verify returns, the branch keyed by what was committed (d1..dj, t) is round r+1's
draft, with no draft call on its critical path (a hit); a miss drafts as before. A branch is
used only when the committed prefix is exactly the one it was drawn from and it carries
the q its tokens were drawn from, so the output stays lossless; its draws use the seed a
fresh draft of round r+1 would use, so seeded sampling draws the same either way.

A round without drafts (target-only, or while drafts do not pay) asks the verifier for up
to ``tokens`` of its own (``--plain-tokens``): it decodes them one pass each, in the batch
of its other calls, without the round trip and the gateway's accounting of a round between
two tokens. They are the tokens one-token rounds would give, one after another.

A session no drafter holds yet (a new one, or one whose drafter failed) starts with a lead
round: the verifier alone computes the prompt and the next token while a drafter computes
the prompt and k drafts alongside, so a prompt's time to the first token is the verifier's
alone; greedy, the drafts after the first are the next round's if the verifier's token is
the first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway import clients
from gateway.clients import ReplicaFailed
from gateway.replicas import Replica, ReplicaPool
from gateway.round_plan import RoundPlan, cache_delta, fanout_share, held, part, round_seed
from gateway.round_result import RoundResult, SpecCache
from gateway.session_rounds import SessionRounds
from gateway.tree_width import TreeSwitch, TreeWidth
from services.config import GatewayConfig
from services.errors import Busy, DeadlineExceeded, ResyncRequired, Unavailable
from services.messages import (
    DraftCall,
    DraftResult,
    SpeculateCall,
    VerifyCall,
    VerifyResult,
)
from services.params import SamplingParams
from services.prefix_index import cached_tokens
from services.session_store import Cursor, SessionHandle

log = logging.getLogger(__name__)

ADMIT_WAIT_S = 5.0  # a call waits this long for a replica being admitted when none is


class RoundRunner:
    def __init__(self, config: GatewayConfig, drafters: ReplicaPool,
                 verifiers: ReplicaPool, requests: Callable[[], int] = lambda: 1,
                 index: aioredis.Redis | None = None,
                 steal: Callable[[], tuple[int, int] | None] | None = None) -> None:
        """``requests``: how many requests the gateway runs now (trees back off under load).
        ``index``: the Redis holding the replicas' prefix index (None: route by load).
        ``steal``: the gateway's steal clock (services/steal.py ``Clock``), which the tree
        switch takes its epochs net of."""
        self.config = config
        self.drafters = drafters
        self.verifiers = verifiers
        self._requests = requests
        self._index = index
        self.width = TreeWidth(config.spec_fanout)  # the trees' fan-out, as fits the verify
        self.trees = TreeSwitch(steal=steal)  # whether lone requests' rounds draft trees

    async def run(self, s: SessionRounds, plan: RoundPlan,
                  deadline: Callable[[], float | None]) -> RoundResult:
        """Round ``s.index`` of session ``s``: takes its k drafts from ``s.prefetch`` when
        that holds the branch that was committed, else drafts them with a drafter of
        ``plan.kind`` (k = 0: none), and verifies them; with the speculation cache on,
        drafts the next round's branches meanwhile (``plan.acceptance`` weighs their
        outcomes). A round without drafts asks the verifier for up to ``plan.tokens``
        tokens. Moves the cursors' replicas (who holds the caches), not the tokens: the
        caller commits the result (``SessionRounds.advance``)."""
        h, params, k, kind = s.handle, plan.params, plan.k, plan.kind
        self._learn_trees(s)
        seed, round_index, prefetch = plan.seed, s.index, s.prefetch
        acceptance, logprobs, tokens = plan.acceptance, plan.logprobs, plan.tokens
        if (self.config.lead_round and k and prefetch is None and not h.drafter.length
                and kind == "model"):
            return await self._lead(h, params, k, kind, seed, round_index, deadline, logprobs)
        old = len(h.tokens)
        lag = old - min(h.drafter.length, old) if h.drafter.replica else old  # tokens a draft must feed
        start = time.perf_counter()
        # Plan: the prepared branch that was committed, else a draft call.
        draft, outcome = None, ""
        if k:
            prepared = prefetch.lookup(h.tokens) if prefetch is not None else None
            outcome = "none" if prefetch is None else "used" if prepared else "dropped"
            if prepared is not None:
                draft = part(prepared, stop=k)
            else:
                draft = await self._draft(h, params, k, kind,
                                          round_seed(seed, round_index, "draft"), deadline)
        fresh = draft is not None and outcome != "used"
        # Run: the verify, and the next round's branches alongside it.
        mid = time.perf_counter()
        drafted = draft if draft is not None and draft.token_ids else None
        ahead_tokens = plan.ahead if drafted is None else 0  # decoded ahead: no drafts
        ahead_seed = round_seed(seed, round_index + 1, "verify") if ahead_tokens else 0
        tree_drafter, fanout, trees = None, 0, None
        if drafted is not None and self.config.pipeline and h.drafter.replica:
            tree_drafter, fanout, trees = self._tree(h, k, mid)
        verify = self._verify(h, params, drafted, round_seed(seed, round_index, "verify"),
                              deadline, logprobs, 1 if drafted is not None else tokens,
                              ahead=ahead_tokens, ahead_seed=ahead_seed, beside=fanout > 0,
                              local=plan.local and drafted is None)
        ahead = None
        if fanout:
            valid = old if fresh else min(h.drafter.length, old)
            ahead = asyncio.ensure_future(self._speculate(
                h, tree_drafter, fanout, params, drafted, valid, k,
                round_seed(seed, round_index + 1, "draft"), acceptance, deadline))
        try:
            result = await verify
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
        verified = time.perf_counter()
        spec, cached = await ahead if ahead is not None else (None, 0)
        end = time.perf_counter()
        if spec is not None and spec.width:
            self.width.observe(spec.width, (end - verified) * 1000.0)
        # Account: what the drafter holds past the old tokens (None: unknown to this round).
        tail = None
        if spec is not None:
            tail = drafted.token_ids[: cached - old]
        elif fresh:
            tail = held(draft, old)
        return RoundResult(
            drafted=drafted.token_ids if drafted else (), drafter_tail=tail,
            num_accepted=result.num_accepted, extra_token=result.extra_token,
            draft_ms=(mid - start) * 1000 if fresh else 0.0,
            verify_ms=(verified - mid) * 1000,
            draft_compute_ms=draft.compute_ms if fresh else 0.0,
            verify_compute_ms=result.compute_ms, pipeline=outcome, prefetch=spec,
            warm=result.cache_hit and (not fresh or (draft.cache_hit and lag <= k + 1)),
            waited_ms=(end - mid + (mid - start if fresh else 0.0)) * 1000,
            logprobs=result.logprobs, more=result.more,
            asked=1 if drafted is not None else tokens, trees=trees)

    async def _lead(self, h: SessionHandle, params: SamplingParams, k: int, kind: str,
                    seed: int, round_index: int, deadline, logprobs: int) -> RoundResult:
        """A round for a session no drafter holds (a new one, or its drafter failed): the
        verifier computes the prompt and the next token alone while a drafter computes the
        prompt and k drafts alongside, instead of before it, so the prompt's time to the
        first token is the verifier's alone. Greedy, the drafts after the first are the
        next round's draft if the verifier's token equals the first (a one-branch
        speculation cache); sampling drafts afresh with a warm drafter (so a seeded sample
        draws as it would without this round)."""
        old = len(h.tokens)
        start = time.perf_counter()
        verify = asyncio.ensure_future(self._verify(
            h, params, None, round_seed(seed, round_index, "verify"), deadline, logprobs))
        drafting = asyncio.ensure_future(self._draft(
            h, params, k, kind, round_seed(seed, round_index, "draft"), deadline))
        try:
            result = await verify
        except BaseException:
            drafting.cancel()
            raise
        verified = time.perf_counter()
        try:
            draft = await drafting
        except Exception as exc:  # noqa: BLE001 - optional work: the next round drafts
            log.info("no lead draft for session %s: %s", h.session_id, exc)
            draft = None
        tail, spec = None, None
        if draft is not None:
            tail = held(draft, old)
            if params.greedy and len(draft.token_ids) > 1:
                spec = SpecCache(base=old, branches={(draft.token_ids[0],): part(draft, 1)})
        # Never warm: its cycle is a drafter's catch-up on the whole session beside a
        # one-token verify. Counted as a round without drafts (none verified) it weighed 9-12
        # ms a token against 3.4 for plain rounds of 8 on a 2-core CPU, and with the rare
        # plain rounds weighed heavily, made not drafting look dearer than drafting for lone
        # requests, which then drafted at 0.78x of target-only (docs/performance.md).
        return RoundResult(
            drafted=(), drafter_tail=tail, num_accepted=0, extra_token=result.extra_token,
            draft_ms=0.0, verify_ms=(verified - start) * 1000, draft_compute_ms=0.0,
            verify_compute_ms=result.compute_ms, warm=False, prefetch=spec,
            waited_ms=(time.perf_counter() - start) * 1000, logprobs=result.logprobs)

    def _learn_trees(self, s: SessionRounds) -> None:
        """The tree switch's unit: a round that asked it, from its start to this one's."""
        if s.last is not None and s.last[1].trees is not None and s.last[1].warm:
            started, r = s.last
            self.trees.observe(started, time.perf_counter() - started, len(r.proposed))

    def _tree(self, h: SessionHandle, k: int, now: float
              ) -> tuple[Replica | None, int, bool | None]:
        """Where to draft the next round's tree beside this round's verify: the model
        drafter that holds the session, the branches to ask it for (0: no tree), and the
        tree switch's mode when it was asked (None: no tree could run, or
        --no-tree-switch)."""
        replica = self.drafters.replicas.get(h.drafter.replica)
        if (replica is None or replica.info is None or replica.info.kind != "model"
                or k > replica.info.max_draft_tokens):
            return None, 0, None
        fanout = self._fanout(replica)
        if not fanout:
            return None, 0, None
        if not self.config.tree_switch:
            return replica, fanout, None
        trees = self.trees.mode(now)
        if self.trees.kept_changed():
            log.info("lone requests' drafting rounds now run %s a speculation tree beside "
                     "their verify (tokens per second of rounds: %.0f with, %.0f without)",
                     "with" if self.trees.incumbent else "without",
                     self.trees.rate[True], self.trees.rate[False])
        return replica, fanout if trees else 0, trees

    def _fanout(self, replica) -> int:
        """Branches to ask for: as many as end with the verify, up to --spec-fanout
        (gateway/tree_width.py), when the drafter serves no other call for this gateway and
        the gateway runs at most --spec-max-requests requests, else none. A tree runs
        alone on the drafter's model thread (its passes already hold many tokens), so it
        holds back the batch of other sessions' draft calls, which are on their rounds'
        critical paths; and where drafter and verifier share cores its CPU slows the
        verifier's passes. Side by side on one 2-core mesh with step batching
        (docs/performance.md), trees against none: 1 stream +37%, 2 equal, 4 to 16 streams
        5-9% slower."""
        busy = replica.inflight + replica.load.get("queue_depth", 0)
        return fanout_share(self.width.branches(), busy, self._requests(),
                            self.config.spec_max_requests)

    async def _speculate(self, h: SessionHandle, replica: Replica, fanout: int,
                         params: SamplingParams, drafted: DraftResult, valid: int, k: int,
                         seed: int, acceptance: float, deadline) -> tuple[SpecCache | None, int]:
        """Round r+1's drafts for the likely outcomes of this round's verify, ``fanout``
        branches from ``replica``, the model drafter that holds the session (``valid`` of
        the committed tokens are in its cache). Any failure just means nothing is prepared:
        the next round drafts as usual. Returns (the cache, tokens the drafter holds after
        the call)."""
        base = min(valid, len(h.tokens) - 1)  # logits from the last committed token on
        call = SpeculateCall(
            cache=cache_delta(h, base, drafted.token_ids), num_drafts=len(drafted.token_ids),
            num_tokens=k, params=params, seed=seed, max_support=self.config.max_support,
            max_branches=fanout, acceptance=acceptance)
        try:
            result = await clients.speculate(replica, call, self._timeout(deadline))
        except Exception as exc:  # noqa: BLE001 - optional work: any failure = not prepared
            log.info("no speculation cache for session %s: %s", h.session_id, exc)
            return None, 0
        branches = {(*drafted.token_ids[: b.accepted], b.token): b.draft
                    for b in result.branches}
        return SpecCache(base=len(h.tokens), branches=branches, width=fanout), result.cached_len

    def _timeout(self, deadline: Callable[[], float | None]) -> float:
        remaining = deadline()
        if remaining is None:
            return self.config.rpc_timeout_s
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed before it finished")
        return min(self.config.rpc_timeout_s, remaining)

    async def _on_replica(self, h: SessionHandle, pool: ReplicaPool, role: str, call,
                          kind: str = "", deadline: Callable[[], float | None] = lambda: None):
        """Runs ``call(replica, base_len)`` on the replica holding the session's cache (role
        "drafter" or "verifier"), resyncing from base 0 when asked; a failed replica is marked
        down and the next one tried from scratch. None when no replica could answer. A call
        cut short by the request's own deadline is the request's failure, not the replica's;
        a replica where the session stays busy (``clients.when_free``) is passed over, not
        marked down, and Busy is raised when no other one answered. While no verifier is
        admitted and some are being admitted (a rollout that replaced them all), the call
        waits up to ADMIT_WAIT_S for one (``ReplicaPool.admitted``); a round without a
        drafter runs without drafts instead."""
        cursor: Cursor = h.verifier if role == "verifier" else h.drafter
        holder, valid = cursor.replica, cursor.length
        if role == "verifier" and pool.admitting:  # (no drafter: the round has no drafts)
            left = deadline()
            await pool.admitted(ADMIT_WAIT_S if left is None else
                                max(0.0, min(ADMIT_WAIT_S, left)))
        tried: set[str] = set()
        busy: ReplicaFailed | None = None
        cached = await self._cached(pool, role, h, holder, kind)
        while (replica := pool.pick(holder, frozenset(tried), kind, cached,
                                    self.config.prefix_affinity)) is not None:
            base = min(valid, len(h.tokens) - 1) if replica.address == holder else 0
            try:
                try:
                    result = await clients.when_free(partial(call, replica, base), deadline)
                except ResyncRequired:
                    result = await clients.when_free(partial(call, replica, 0), deadline)
            except (ReplicaFailed, ResyncRequired) as exc:
                if isinstance(exc, ReplicaFailed) and clients.busy(exc):
                    busy = exc  # still busy after clients.when_free: not the replica's fault
                    tried.add(replica.address)
                    continue
                left = deadline()
                if (isinstance(exc, ReplicaFailed) and left is not None and left < 0.05
                        and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise DeadlineExceeded(
                        "the request's deadline passed before it finished") from exc
                log.warning("%s %s failed for session %s (%s); trying another", role,
                            replica.address, h.session_id, exc)
                pool.mark_down(replica)
                tried.add(replica.address)
                continue
            pool.mark_ok(replica)
            cursor.replica = replica.address
            return result
        if busy is not None:
            raise Busy(f"session {h.session_id} is still busy on {role} {busy.replica.address} "
                       f"with a call of an earlier request: retry") from busy
        return None

    async def _cached(self, pool: ReplicaPool, role: str, h: SessionHandle, holder: str,
                      kind: str) -> dict[str, int]:
        """address -> committed tokens of the session the prefix index says each replica
        holds, when the session needs placing (no replica holds it, or the one that does is
        down) and there is a choice; else (and when Redis cannot tell) {}."""
        current = pool.replicas.get(holder)
        if self._index is None or self.config.prefix_affinity < 0 or (
                current is not None and current.up):
            return {}
        replicas = [(r.address, r.info.prefix_block_size) for r in pool.replicas.values()
                    if r.admitted and r.info is not None and r.info.prefix_block_size > 0
                    and (not kind or r.info.kind == kind)]
        if len(replicas) < 2:
            return {}
        try:
            return await cached_tokens(self._index, role, h.tokens, replicas)
        except RedisError as exc:
            log.info("prefix index unreadable (%s): placing session %s by load", exc,
                     h.session_id)
            return {}

    async def _draft(self, h: SessionHandle, params: SamplingParams, k: int, kind: str,
                     seed: int, deadline) -> DraftResult | None:
        """Drafts k tokens; None (no drafter could answer) runs the round with k = 0."""

        async def call(replica, base: int) -> DraftResult:
            delta = cache_delta(h, base)
            return await clients.draft(replica, DraftCall(
                cache=delta, num_tokens=k, params=params, seed=seed,
                max_support=self.config.max_support), self._timeout(deadline))

        try:
            result = await self._on_replica(h, self.drafters, "drafter", call, kind, deadline)
            why = "no drafter reachable"
        except Busy:
            result, why = None, "the session's earlier call still runs on its drafter"
        if result is None:
            log.warning("%s: session %s runs this round without drafts", why, h.session_id)
            h.drafter.reset()
        return result

    async def _verify(self, h: SessionHandle, params: SamplingParams,
                      draft: DraftResult | None, seed: int, deadline,
                      logprobs: int = -1, tokens: int = 1, ahead: int = 0,
                      ahead_seed: int = 0, beside: bool = False, local: bool = False
                      ) -> VerifyResult:
        """``ahead`` (no ``draft``): the next round's tokens, which the verifier decodes once
        it answers (verifier_svc/decode_ahead.py), from ``ahead_seed``. ``beside``: a tree
        is drafted meanwhile (VerifyCall.beside). ``local`` (no ``draft``): the verifier may
        draft with its own draft model (VerifyCall.local)."""
        sparse = draft is not None and not params.greedy

        async def call(replica, base: int) -> VerifyResult:
            return await clients.verify(replica, VerifyCall(
                cache=cache_delta(h, base),
                draft_ids=draft.token_ids if draft else (),
                q_ids=draft.q_ids if sparse else (), q_probs=draft.q_probs if sparse else (),
                params=params, seed=seed, logprobs=logprobs, max_tokens=tokens,
                ahead=ahead, ahead_seed=ahead_seed, beside=beside, local=local),
                self._timeout(deadline))

        result = await self._on_replica(h, self.verifiers, "verifier", call, deadline=deadline)
        if result is None:
            raise Unavailable(f"no verifier replica could serve the request (of "
                              f"{len(self.verifiers)} configured): retry later")
        return result
