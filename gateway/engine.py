"""The gateway's round loop: draft -> verify -> accept, one round per streamed chunk.

Per round (Leviathan et al. 2023): a drafter proposes k tokens with their
sparse q; the verifier scores them in one forward pass and returns how many
it accepted plus one token of its own; the gateway commits those tokens to
the session handle in Redis (compare-and-set on the version), detokenizes
them and streams them. Caches are addressed by deltas: each call names the
prefix the replica is assumed to hold (length + hash) and sends only the rest.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway import clients
from gateway.clients import ReplicaFailed
from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from gateway.replicas import ReplicaPool
from gateway.requests import GenerationSpec
from services.config import GatewayConfig
from services.errors import (
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    ResyncRequired,
    Unavailable,
)
from services.hashing import token_hash
from services.messages import CacheDelta, DraftCall, DraftResult, VerifyCall, VerifyResult
from services.session_store import SessionHandle, SessionStore

log = logging.getLogger(__name__)


class Finish(enum.Enum):
    LENGTH = 1
    EOS = 2
    STOP = 3
    CONTEXT = 4


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    session_id: str
    finish: Finish | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class TargetLimits:
    """What the gateway needs to know of the target, from the verifiers' ModelInfo."""

    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    fingerprint: str


@dataclass
class _Request:
    spec: GenerationSpec
    handle: SessionHandle
    owner: str
    seed: int
    deadline: Callable[[], float | None]
    usage: Usage = field(default_factory=Usage)


def round_seed(seed: int, round_index: int, role: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{round_index}:{role}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _delta(session_id: str, tokens: list[int], base: int) -> CacheDelta:
    return CacheDelta(session_id=session_id, base_len=base, base_hash=token_hash(tokens[:base]),
                      new_tokens=tuple(tokens[base:]))


class GenerationEngine:
    def __init__(self, config: GatewayConfig, tokenizer, limits: TargetLimits,
                 drafters: ReplicaPool, verifiers: ReplicaPool, store: SessionStore) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.drafters = drafters
        self.verifiers = verifiers
        self.store = store
        self._inflight = 0

    # ----- request lifecycle -------------------------------------------------------------

    async def generate(self, spec: GenerationSpec,
                       deadline: Callable[[], float | None] = lambda: None) -> AsyncIterator[Chunk]:
        if self._inflight >= self.config.max_inflight:
            raise Overloaded(f"gateway is at its limit of {self.config.max_inflight} concurrent "
                             "requests: retry later")
        self._inflight += 1
        try:
            req = await self._start(spec, deadline)
            try:
                async for chunk in self._rounds(req):
                    yield chunk
            finally:
                await self._finish(req)
        finally:
            self._inflight -= 1

    async def _tokenize(self, spec: GenerationSpec, continuing: bool) -> list[int]:
        if spec.prompt_ids:
            ids = list(spec.prompt_ids)
            bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise InvalidArgument(f"prompt_token_ids contains ids outside the vocabulary "
                                      f"[0, {self.limits.vocab_size}): {bad[:5]}")
            return ids
        if not spec.prompt:
            return []
        encoded = await asyncio.to_thread(self.tokenizer, spec.prompt,
                                          add_special_tokens=not continuing)
        return list(encoded["input_ids"])

    async def _start(self, spec: GenerationSpec, deadline) -> _Request:
        owner = uuid.uuid4().hex
        if spec.session_id:
            handle = await self.store.load(spec.session_id)
            await self.store.acquire(spec.session_id, owner)
            try:
                prompt = await self._tokenize(spec, continuing=True)
                self._check_context(len(handle.tokens) + len(prompt), len(prompt))
            except BaseException:
                await self.store.release(spec.session_id, owner)
                raise
            if prompt:
                handle.tokens.extend(prompt)
                await self.store.commit(handle, prompt, owner)
        else:
            prompt = await self._tokenize(spec, continuing=False)
            if not prompt:
                raise InvalidArgument("prompt tokenizes to no tokens: send a non-empty prompt")
            self._check_context(len(prompt), len(prompt))
            handle = SessionHandle(session_id=uuid.uuid4().hex, version=1, tokens=list(prompt),
                                   target=self.limits.fingerprint, keep=spec.keep_session)
            await self.store.acquire(handle.session_id, owner)
            await self.store.create(handle)
        handle.sampling = {"temperature": spec.params.temperature, "top_k": spec.params.top_k,
                           "top_p": spec.params.top_p}
        seed = spec.seed if spec.seed is not None else secrets.randbits(63)
        req = _Request(spec=spec, handle=handle, owner=owner, seed=seed, deadline=deadline)
        req.usage.prompt_tokens = len(prompt)
        return req

    def _check_context(self, total: int, prompt_len: int) -> None:
        if total >= self.limits.max_context:
            raise InvalidArgument(
                f"the prompt ({prompt_len} tokens, {total} with the session's earlier turns) "
                f"leaves no room in the model's context of {self.limits.max_context} tokens: "
                "shorten it")

    async def _finish(self, req: _Request) -> None:
        h = req.handle
        try:
            if h.keep:
                await self.store.release(h.session_id, req.owner)
                return
            await self.store.delete(h.session_id)
        except Unavailable as exc:
            log.warning("could not finish session %s: %s", h.session_id, exc)
        for pool, address in ((self.verifiers, h.verifier), (self.drafters, h.drafter)):
            replica = pool.replicas.get(address)
            if replica is not None:
                try:
                    await clients.release(replica, h.session_id, timeout=2.0)
                except (ReplicaFailed, InvalidArgument) as exc:
                    log.info("release of %s on %s failed: %s", h.session_id, address, exc)

    # ----- rounds ------------------------------------------------------------------------

    def _timeout(self, req: _Request) -> float:
        remaining = req.deadline()
        if remaining is None:
            return self.config.rpc_timeout_s
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed before it finished")
        return min(self.config.rpc_timeout_s, remaining)

    def _choose_k(self, req: _Request, generated: int) -> int:
        spec = req.spec
        if not spec.speculate or len(self.drafters) == 0:
            return 0
        k = spec.num_draft_tokens or self.config.num_draft_tokens
        room = self.limits.max_context - len(req.handle.tokens) - 1
        return max(0, min(k, spec.max_new_tokens - generated - 1, room))

    async def _rounds(self, req: _Request) -> AsyncIterator[Chunk]:
        spec, h = req.spec, req.handle
        detok = IncrementalDetokenizer(self.tokenizer, list(h.tokens))
        stop = StopMatcher(list(spec.stop))
        generated = 0
        finish: Finish | None = None
        while finish is None:
            if len(h.tokens) >= self.limits.max_context:
                finish = Finish.CONTEXT
                break
            k = self._choose_k(req, generated)
            index = req.usage.rounds
            draft = await self._draft(req, k, round_seed(req.seed, index, "draft")) if k else None
            result = await self._verify(req, draft, round_seed(req.seed, index, "verify"))
            drafted = list(draft.token_ids) if draft else []
            proposed = drafted[: result.num_accepted] + [result.extra_token]

            kept: list[int] = []
            text = ""
            for token in proposed:
                kept.append(token)
                generated += 1
                if token in self.limits.eos_token_ids:
                    finish = Finish.EOS
                    break
                piece, stopped = stop.feed(detok.push([token]))
                text += piece
                if stopped:
                    finish = Finish.STOP
                    break
                if generated >= spec.max_new_tokens:
                    finish = Finish.LENGTH
                    break
            if finish is None and len(h.tokens) + len(kept) >= self.limits.max_context:
                finish = Finish.CONTEXT
            if finish is not None and finish is not Finish.STOP:
                tail, stopped = stop.feed(detok.flush())
                text += tail
                if stopped:
                    finish = Finish.STOP
                else:
                    text += stop.flush()

            old_len = len(h.tokens)
            h.verifier_len = old_len + min(result.num_accepted, len(kept))
            if draft is not None:
                h.drafter_len = old_len + min(result.num_accepted, len(kept), len(drafted) - 1)
            h.tokens.extend(kept)
            req.usage.rounds += 1
            req.usage.draft_tokens += len(drafted)
            req.usage.accepted_draft_tokens += result.num_accepted
            req.usage.completion_tokens = generated
            await self.store.commit(h, kept, req.owner)
            yield Chunk(text=text, token_ids=kept, session_id=h.session_id, finish=finish,
                        usage=req.usage if finish else None)

    async def _on_replica(self, req: _Request, pool: ReplicaPool, role: str, call):
        """Runs ``call(replica, base_len)`` on the replica holding the session's cache (role
        "drafter" or "verifier"), resyncing from base 0 when asked; a failed replica is marked
        down and the next one tried from scratch. None when no replica could answer."""
        h = req.handle
        holder, valid = getattr(h, role), getattr(h, f"{role}_len")
        tried: set[str] = set()
        while (replica := pool.pick(holder, frozenset(tried))) is not None:
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

    async def _draft(self, req: _Request, k: int, seed: int) -> DraftResult | None:
        """Drafts k tokens; None (no drafter could answer) runs the round with k = 0."""
        result = await self._on_replica(
            req, self.drafters, "drafter",
            lambda replica, base: self._draft_call(req, replica, base, k, seed))
        if result is None:
            log.warning("no drafter reachable: session %s runs this round without drafts",
                        req.handle.session_id)
            req.handle.drafter, req.handle.drafter_len = "", 0
        return result

    async def _draft_call(self, req: _Request, replica, base: int, k: int,
                          seed: int) -> DraftResult:
        call = DraftCall(cache=_delta(req.handle.session_id, req.handle.tokens, base),
                         num_tokens=k, params=req.spec.params, seed=seed,
                         max_support=self.config.max_support)
        return await clients.draft(replica, call, self._timeout(req))

    async def _verify(self, req: _Request, draft: DraftResult | None, seed: int) -> VerifyResult:
        result = await self._on_replica(
            req, self.verifiers, "verifier",
            lambda replica, base: self._verify_call(req, replica, base, draft, seed))
        if result is None:
            raise Unavailable(f"no verifier replica could serve the request (of "
                              f"{len(self.verifiers)} configured): retry later")
        return result

    async def _verify_call(self, req: _Request, replica, base: int, draft: DraftResult | None,
                           seed: int) -> VerifyResult:
        call = VerifyCall(
            cache=_delta(req.handle.session_id, req.handle.tokens, base),
            draft_ids=draft.token_ids if draft else (),
            q_ids=draft.q_ids if draft and not req.spec.params.greedy else (),
            q_probs=draft.q_probs if draft and not req.spec.params.greedy else (),
            params=req.spec.params, seed=seed)
        return await clients.verify(replica, call, self._timeout(req))

    async def close_session(self, session_id: str) -> int:
        """Deletes a session and frees its caches; returns its committed token count."""
        if not session_id:
            raise InvalidArgument("session_id is required")
        handle = await self.store.load(session_id)
        owner = uuid.uuid4().hex
        await self.store.acquire(session_id, owner)
        handle.keep = False
        req = _Request(spec=None, handle=handle, owner=owner, seed=0,  # type: ignore[arg-type]
                       deadline=lambda: None)
        await self._finish(req)
        return len(handle.tokens)
