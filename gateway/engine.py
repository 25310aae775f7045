"""The gateway's request lifecycle: session in Redis, rounds, streaming, telemetry.

Each request takes its session's lease, runs rounds (gateway/rounds.py) until
EOS, a stop string, max_new_tokens or the context limit, commits every round's
tokens to the session handle (compare-and-set on the version) and streams
them as one chunk per round with incremental detokenization. While Redis is
unreachable the tokens stay pending and the stream goes on (see _save).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

from opentelemetry import metrics as metrics_api
from opentelemetry import trace

from gateway import clients
from gateway.chunks import Chunk, Finish, TargetLimits, Usage
from gateway.clients import ReplicaFailed
from gateway.commits import CommitBatcher
from gateway.draft_length import DraftLength
from gateway.replicas import ReplicaPool
from gateway.requests import GenerationSpec
from gateway.round_plan import RoundPlan
from gateway.round_result import RoundResult
from gateway.rounds import RoundRunner
from gateway.session_rounds import RequestState, SessionRounds
from gateway.step_batch import StepBatcher, steps_sent
from gateway.telemetry import RequestTelemetry
from gateway.turn_text import TurnText
from gateway.turns import TurnRecord, resume_chunk, resumed_spec, turn_to_resume
from services import steal
from services.config import GatewayConfig
from services.errors import InvalidArgument, Overloaded, PermissionDenied, Unavailable
from services.metrics import GatewayMetrics
from services.session_store import SessionHandle, SessionStore

log = logging.getLogger(__name__)

# How to add the missing drafter kind, in the INVALID_ARGUMENT of a request that names it.
_START_ONE = {"ngram": ": start one (`specmesh drafter --kind ngram`, listed in the gateway's "
                       "--drafters; a local mesh: `specmesh up --ngram-drafters 1`)",
              "model": ": start one (`specmesh drafter --model DRAFT`, listed in the gateway's "
                       "--drafters; a local mesh: `specmesh up --drafters 1`)"}


class GenerationEngine:
    def __init__(self, config: GatewayConfig, tokenizer, limits: TargetLimits,
                 drafters: ReplicaPool, verifiers: ReplicaPool, store: SessionStore,
                 tracer: trace.Tracer | None = None,
                 meter: metrics_api.Meter | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.drafters = drafters
        self.verifiers = verifiers
        self.store = store
        clock = steal.Clock()  # one steal clock for the gateway's switches
        self.rounds = RoundRunner(config, drafters, verifiers, lambda: self._inflight,
                                  index=store.client, steal=clock)
        meter = meter or metrics_api.NoOpMeterProvider().get_meter("specmesh")
        self.metrics = GatewayMetrics(
            meter, lambda: self._inflight,
            lambda: [(kind, level, s) for (kind, level), s in list(self.k.switches.items())],
            lambda: self.rounds.trees)
        # a round's commit goes with those of its step's other sessions
        # (after the wave's steps went out: the steps are on every session's critical path)
        self.commits = CommitBatcher(store, on_pipeline=self.metrics.commit_batch.record,
                                     first=lambda: steps_sent(self._step_batchers))
        self.telemetry = RequestTelemetry(tracer or trace.get_tracer("specmesh"), self.metrics,
                                          limits.model)
        self.k = DraftLength(config, limits, drafters, lambda: self._inflight, steal=clock)
        verifiers.merge_plain = self.k.merge_plain
        verifiers.lone = drafters.lone = lambda: self._inflight <= 1
        self._inflight = 0
        self._background: set[asyncio.Task] = set()  # clean-ups still running

    def _step_batchers(self) -> list[StepBatcher]:
        return [b for pool in (self.verifiers, self.drafters)
                for replica in pool.replicas.values() for b in replica.steps.values()]

    # ----- request lifecycle -------------------------------------------------------------

    async def generate(self, spec: GenerationSpec,
                       deadline: Callable[[], float | None] = lambda: None,
                       tenant: str | None = None) -> AsyncIterator[Chunk]:
        """``tenant``: the API key's name (None when the gateway has no keys); a session
        belongs to the key that created it."""
        if self._inflight >= self.config.max_inflight:
            raise Overloaded(f"gateway is at its limit of {self.config.max_inflight} concurrent "
                             "requests: retry later")
        self._inflight += 1
        self.metrics.active.add(1)
        may_draft = None
        arrived = time.perf_counter()
        try:
            req = await self._start(spec, deadline, tenant)
            # the time to the first token counts the request's setup too (tokenizing a long
            # prompt, the session's create in Redis): 11-16 ms at 16 streams on a 2-core CPU
            req.started = arrived
            may_draft = self.k.running(spec)
            span = self.telemetry.generate_span(req)
            completed = False
            try:
                async for chunk in self._stream(req, span):
                    yield chunk
                completed = True
            except BaseException as exc:
                span.record_exception(exc)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                raise
            finally:
                span.end()
                await self._end_session(req.handle, req.owner)
                if not req.handle.keep:
                    if completed:  # its caches are freed after the response, not before it
                        self._in_background(self._free_caches(req.handle))
                    else:
                        await self._free_caches(req.handle)
        finally:
            self._inflight -= 1
            if may_draft is not None:
                self.k.ended(may_draft)
            self.metrics.active.add(-1)

    async def _tokenize(self, spec: GenerationSpec, continuing: bool) -> list[int]:
        if spec.prompt_ids:  # checked against the vocabulary by gateway/requests.validate
            return list(spec.prompt_ids)
        if not spec.prompt:
            return []
        encoded = await asyncio.to_thread(self.tokenizer, spec.prompt,
                                          add_special_tokens=not continuing)
        return list(encoded["input_ids"])

    async def _start(self, spec: GenerationSpec, deadline, tenant: str | None) -> RequestState:
        if spec.speculate and spec.drafter_kind and spec.drafter_kind not in self.drafters.kinds():
            raise InvalidArgument(f"no {spec.drafter_kind} drafter is configured on this gateway "
                                  f"(kinds: {', '.join(sorted(self.drafters.kinds())) or 'none'})"
                                  f"{_START_ONE.get(spec.drafter_kind, '')}", field="drafter")
        owner = uuid.uuid4().hex
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        if spec.session_id:
            handle = await self._load(spec.session_id, tenant)
            await self.store.acquire(spec.session_id, owner)
            try:
                if spec.resume_from:
                    turn = turn_to_resume(handle.session_id, handle.turn, len(handle.tokens),
                                          spec.resume_from)
                    return self._resumed_request(resumed_spec(spec, turn), handle, owner, turn,
                                                 deadline)
                prompt = await self._tokenize(spec, continuing=True)
                self._check_context(len(handle.tokens) + len(prompt), len(prompt))
            except BaseException:
                await self.store.release(spec.session_id, owner)
                raise
            handle.tokens.extend(prompt)
            turn = TurnRecord.begin(spec, len(handle.tokens), len(prompt), seed)
            handle.turn = turn.to_dict()
            await self.commits.commit(handle, prompt, owner)
        else:
            prompt = await self._tokenize(spec, continuing=False)
            if not prompt:
                raise InvalidArgument("prompt tokenizes to no tokens: send a non-empty prompt",
                                      field="prompt")
            self._check_context(len(prompt), len(prompt))
            turn = TurnRecord.begin(spec, len(prompt), len(prompt), seed)
            handle = SessionHandle(session_id=uuid.uuid4().hex, version=1, tokens=list(prompt),
                                   target=self.limits.fingerprint, keep=spec.keep_session,
                                   tenant=tenant or "", turn=turn.to_dict())
            await self.store.create(handle, owner)  # (its lease taken with it)
        req = RequestState(spec=spec, rounds=SessionRounds(handle), owner=owner, seed=seed,
                           deadline=deadline, turn=turn)
        req.usage.prompt_tokens = len(prompt)
        return req

    @staticmethod
    def _resumed_request(spec: GenerationSpec, h: SessionHandle, owner: str, turn: TurnRecord,
                         deadline) -> RequestState:
        """The request a resume continues, with its progress so far (round index, usage)."""
        req = RequestState(spec=spec, rounds=SessionRounds(h, index=turn.rounds), owner=owner,
                           seed=turn.seed, deadline=deadline, turn=turn)
        req.generated = len(h.tokens) - turn.start
        req.usage = Usage(prompt_tokens=turn.prompt_tokens, completion_tokens=req.generated,
                          rounds=turn.rounds, draft_tokens=turn.draft_tokens,
                          accepted_draft_tokens=turn.accepted_draft_tokens)
        return req

    async def _load(self, session_id: str, tenant: str | None) -> SessionHandle:
        handle = await self.store.load(session_id)
        if tenant is not None and handle.tenant != tenant:
            raise PermissionDenied(f"session {session_id!r} belongs to another API key: only "
                                   "the key that created a session can continue or close it")
        return handle

    def _check_context(self, total: int, prompt_len: int) -> None:
        if total >= self.limits.max_context:
            raise InvalidArgument(
                f"the prompt ({prompt_len} tokens, {total} with the session's earlier turns) "
                f"leaves no room in the model's context of {self.limits.max_context} tokens: "
                "shorten it", field="prompt")

    def _in_background(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    async def _end_session(self, h: SessionHandle, owner: str) -> None:
        """A kept session gives up its lease; any other is deleted from the store."""
        try:
            if h.keep:
                await self.store.release(h.session_id, owner)
            else:
                await self.store.delete(h.session_id)
        except Unavailable as exc:
            log.warning("could not finish session %s: %s", h.session_id, exc)

    async def _free_caches(self, h: SessionHandle) -> None:
        """Releases a deleted session's caches on the replicas that hold them."""
        for pool, address in ((self.verifiers, h.verifier.replica), (self.drafters, h.drafter.replica)):
            replica = pool.replicas.get(address)
            if replica is not None:
                try:
                    await clients.release(replica, h.session_id, timeout=2.0)
                except (ReplicaFailed, InvalidArgument) as exc:
                    log.info("release of %s on %s failed: %s", h.session_id, address, exc)

    # ----- rounds ------------------------------------------------------------------------

    async def _stream(self, req: RequestState, span: trace.Span) -> AsyncIterator[Chunk]:
        spec, h = req.spec, req.handle
        text = TurnText(self.tokenizer, h.tokens[:req.turn.start], spec.stop,
                        self.limits.eos_token_ids)
        kind = self.k.kind(spec)
        finish: Finish | None = None
        if spec.resume_from:
            chunk = resume_chunk(h.session_id, h.tokens, req.turn, spec.resume_from, text,
                                 req.usage)
            yield chunk
            if chunk.finish is not None:
                return
        # Round r+1 runs while round r's tokens are saved; r's chunk goes out once they are.
        running: asyncio.Future | None = None
        saving: asyncio.Future | None = None
        held: Chunk | None = None
        try:
            if len(h.tokens) < self.limits.max_context:
                running = asyncio.ensure_future(self._round(req, kind, span))
            while True:
                if saving is not None:
                    await saving
                    saving = None
                    yield held
                if finish is not None:
                    return
                if running is None:  # the context is full
                    finish = Finish.CONTEXT
                    self.telemetry.record_finish(span, req, finish)
                    yield Chunk(text=text.flush(), token_ids=[], session_id=h.session_id,
                                finish=finish, usage=req.usage, offset=len(h.tokens))
                    return
                r, start, round_span = await running
                running = None
                with trace.use_span(round_span, end_on_exit=True):
                    self.k.learn(req, kind, r)
                    kept, shown, finish = text.accept(
                        r.proposed, spec.max_new_tokens - req.generated,
                        self.limits.max_context - len(h.tokens))
                    req.generated += len(kept)
                    req.rounds.advance(r, kept, start)
                    self._commit_counts(req, r, kept, finish)
                    self.telemetry.record_round(round_span, req, r, len(kept),
                                                time.perf_counter() - start)
                if finish is not None:
                    self.verifiers.forget(h.session_id)  # no step waits for its next call
                    self.telemetry.record_finish(span, req, finish)
                held = Chunk(text=shown, token_ids=kept, session_id=h.session_id, finish=finish,
                             usage=req.usage if finish else None,
                             offset=len(h.tokens) - len(kept), logprobs=r.logprobs[:len(kept)])
                if finish is None and len(h.tokens) < self.limits.max_context:
                    # the next round before the save: its verify call is on every session's
                    # critical path, the commit only on this chunk's (the step batcher then
                    # sends the step before the commit batcher packs its pipeline)
                    running = asyncio.ensure_future(self._round(req, kind, span))
                saving = asyncio.ensure_future(self._save(req, len(kept),
                                                          final=finish is not None))
        finally:
            self.verifiers.forget(h.session_id)  # (ended by an error, or cancelled)
            for task in (running, saving):
                if task is not None and not task.done():
                    task.cancel()

    async def _round(self, req: RequestState, kind: str,
                     span: trace.Span) -> tuple[RoundResult, float, trace.Span]:
        """Chooses k and runs the request's next round under its own span (ended by the
        caller once the round is accounted for)."""
        start = time.perf_counter()
        self.k.learn_cycle(req, kind, start)
        plain = self._plain_tokens(req)
        k = self.k.choose(req, kind, plain)
        round_span = self.telemetry.round_span(span, req, k)
        try:
            with trace.use_span(round_span):
                plan = RoundPlan(req.spec.params, k, kind, req.seed,
                                 acceptance=self.k.acceptance_of(
                                     kind, len(req.handle.tokens)).alpha(0.7),
                                 logprobs=req.spec.logprobs, tokens=plain,
                                 ahead=0 if k else self._ahead_tokens(req, plain),
                                 local=_local_drafts(req.spec))
                r = await self.rounds.run(req.rounds, plan, req.deadline)
        except BaseException:
            round_span.end()
            raise
        return r, start, round_span

    def _plain_tokens(self, req: RequestState) -> int:
        """Tokens a round without drafts asks for: ``_plain_cap`` within the request's budget
        and the context; but one in the request's first round (its time to the first token)."""
        if req.rounds.last is None:
            return 1
        return max(1, min(self._plain_cap(req), self._tokens_left(req)))

    def _ahead_tokens(self, req: RequestState, plain: int) -> int:
        """The tokens a round without drafts asks the verifier to decode ahead: what the
        next round asks for (``_plain_tokens``) once this round's ``plain`` are in; 0 where
        none can follow (the request's budget or the context ends with this round) or with
        --no-decode-ahead, and where the next round will draft (a probe is due): that round
        would stop the job and wait for its pass. A round that keeps fewer (a stop string)
        ends the request."""
        if not self.config.decode_ahead or self.k.drafts_next(req):
            return 0
        return max(0, min(self._plain_cap(req), self._tokens_left(req) - plain))

    def _plain_cap(self, req: RequestState) -> int:
        """--plain-tokens; one for a seeded sample, whose draws use one seed a round: how
        many tokens a round gets depends on the other calls of its step (fit_verify_step),
        and a seed must reproduce whatever else runs."""
        seeded = req.spec.seed is not None and not req.spec.params.greedy
        return 1 if seeded else self.config.plain_tokens

    def _tokens_left(self, req: RequestState) -> int:
        """What the request's budget and the model's context still allow."""
        return min(req.spec.max_new_tokens - req.generated,
                   self.limits.max_context - len(req.handle.tokens))

    async def _save(self, req: RequestState, added: int, final: bool) -> None:
        """Commits the round's ``added`` tokens and any an earlier round left pending. While
        Redis is unreachable the stream goes on and the tokens stay pending (h.tokens holds
        them; the next commit sends them all). At the end a kept session retries for up to
        --store-outage-s (and the client's deadline); an ephemeral one is not waited for."""
        h = req.handle
        req.pending += added
        delay, give_up = 0.05, None
        while True:
            try:
                await self.commits.commit(h, h.tokens[len(h.tokens) - req.pending:], req.owner)
                req.pending = 0
                return
            except Unavailable as exc:
                if give_up is None and req.pending == added:  # once per outage
                    log.warning("session %s: %s; its tokens stay pending", h.session_id, exc)
                if not (final and h.keep):
                    return
                if give_up is None:
                    budget, left = self.config.store_outage_s, req.deadline()
                    give_up = time.monotonic() + (budget if left is None else min(budget, left))
                if time.monotonic() >= give_up:
                    raise Unavailable(
                        f"the generation finished, but the session's last {req.pending} tokens "
                        "could not be saved: the session store (Redis) stayed unreachable "
                        f"({exc.__cause__ or exc}); the session holds the tokens before them"
                    ) from exc
            await asyncio.sleep(max(0.0, min(delay, give_up - time.monotonic())))
            delay = min(2 * delay, 0.5)

    def _commit_counts(self, req: RequestState, r: RoundResult, kept: list[int],
                       finish: Finish | None) -> None:
        """Counts the round, whose ``kept`` tokens were committed to the handle, in the
        request's usage and the turn's record (saved with the commit)."""
        req.usage.rounds = req.rounds.index
        req.usage.draft_tokens += len(r.drafted)
        req.usage.accepted_draft_tokens += r.num_accepted
        req.usage.completion_tokens = req.generated
        turn = req.turn
        turn.rounds, turn.draft_tokens = req.usage.rounds, req.usage.draft_tokens
        turn.accepted_draft_tokens = req.usage.accepted_draft_tokens
        turn.finish = finish.name if finish is not None else ""
        req.handle.turn = turn.to_dict()

    async def close_session(self, session_id: str, tenant: str | None = None) -> int:
        """Deletes a session and frees its caches; returns its committed token count."""
        if not session_id:
            raise InvalidArgument("session_id is required")
        handle = await self._load(session_id, tenant)
        owner = uuid.uuid4().hex
        await self.store.acquire(session_id, owner)
        handle.keep = False
        await self._end_session(handle, owner)
        await self._free_caches(handle)
        return len(handle.tokens)


def _local_drafts(spec: GenerationSpec) -> bool:
    """Whether the request's rounds without drafts may draft with a verifier's own draft
    model (VerifyCall.local): where it speculates, and its output does not depend on how
    its tokens were drawn (greedy), or no seed asks for the same draws every time."""
    return spec.speculate and (spec.params.greedy or spec.seed is None)
