"""The verifier: scores a session's pending tokens plus k drafts in ONE forward pass
(shared with the calls of other sessions that arrive meanwhile: services/batching.py).

It appends ``new_tokens + drafts`` to the session's target KV cache, applies
the lossless acceptance rule (services.sampling), crops the cache to the
committed length and returns the accepted count and the one extra token.

A call without drafts may ask for up to ``max_tokens`` (a plain round: the gateway's
--plain-tokens): after the extra token the job stays in the running batch and decodes
each next token from the one before, one pass each, until it has them or one is an
end-of-sequence token. The tokens are those one-token calls would return, one after
another; what the calls between them cost (a round trip, the gateway's accounting of the
round, the verifier's handling of a call) is paid once for all of them. Such a call may
also ask for the next such round to start as soon as it is answered
(verifier_svc/decode_ahead.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from services.batching import FeedJob, Row
from services.errors import InvalidArgument
from services.kv_cache import SessionCache
from services.messages import (
    MAX_TOP_LOGPROBS,
    CacheDelta,
    TokenLogprobs,
    VerifyCall,
    VerifyResult,
    check_token_ids,
)
from services.model_runner import ModelEngine, check_delta
from services.sampling import (
    SparseDraft,
    accept_greedy,
    accept_sampled,
    validate_draft,
    warp_logits,
)
from verifier_svc.decode_ahead import Ahead, DecodeAhead
from verifier_svc.local_drafts import LocalDrafter

log = logging.getLogger(__name__)

# A greedy call without drafts (target-only): nothing to build per call. Read-only.
_NO_DRAFT = SparseDraft(token_ids=torch.empty(0, dtype=torch.long),
                        q_ids=torch.empty(0, 1, dtype=torch.long), q_probs=torch.empty(0, 1))
MAX_TOKENS = 64  # the most tokens a call without drafts may ask for (VerifyRequest.max_tokens)
_DRAFT_STREAM = 0x5D_EECE_66D  # a sampled job's local drafts: its seed xor this


class VerifierEngine(ModelEngine):

    def __init__(self, *args, local: LocalDrafter | None = None, **kwargs) -> None:
        """``local``: the verifier's own draft model, which its plain rounds may draft with
        (verifier_svc/local_drafts.py)."""
        super().__init__(*args, **kwargs)
        self.ahead = DecodeAhead(self.stats)
        self.local = local
        self.runner.drafter = local

    def _sparse_draft(self, call: VerifyCall) -> SparseDraft:
        k = len(call.draft_ids)
        if k > self.max_draft_tokens:
            raise InvalidArgument(
                f"{k} draft tokens exceed this verifier's limit of {self.max_draft_tokens}")
        if call.params.greedy:  # only the tokens matter: a plain range check suffices
            if not k:
                return _NO_DRAFT
            check_token_ids(call.draft_ids, self.runner.meta.vocab_size, "draft_token_ids")
            ids = torch.tensor(call.draft_ids, dtype=torch.long)  # [k]
            return SparseDraft(token_ids=ids, q_ids=ids[:, None], q_probs=torch.ones(k, 1))
        if len(call.q_ids) != k or len(call.q_probs) != k:
            raise InvalidArgument(
                f"sampling needs one draft distribution per draft token: got {len(call.q_ids)} "
                f"for {k} tokens")
        width = max((len(ids) for ids in call.q_ids), default=1)
        q_ids = torch.zeros(k, width, dtype=torch.long)  # [k, S]
        q_probs = torch.zeros(k, width)  # [k, S]
        for i, (ids, probs) in enumerate(zip(call.q_ids, call.q_probs, strict=True)):
            if len(ids) != len(probs) or not ids:
                raise InvalidArgument(
                    f"draft distribution {i} needs as many probs as token ids (and at least "
                    "one)")
            q_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            q_probs[i, : len(probs)] = torch.tensor(probs, dtype=torch.float32)
        draft = SparseDraft(token_ids=torch.tensor(call.draft_ids, dtype=torch.long),
                            q_ids=q_ids, q_probs=q_probs)
        try:
            validate_draft(draft, self.runner.meta.vocab_size)
        except ValueError as exc:
            raise InvalidArgument(f"bad draft: {exc}") from exc
        return draft

    async def verify(self, call: VerifyCall) -> VerifyResult:
        outcome, = await self.verify_many([call])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def verify_many(self, calls: Sequence[VerifyCall]) -> list[VerifyResult | Exception]:
        """Each call's result, or the error it alone fails with (a bad request, a stale
        prefix, a second call for one session, a full queue); the calls that pass
        validation share the model's next pass (ModelEngine.run_many). A call that asks for
        its session's decode-ahead job takes it over; other calls stop it first."""
        await self.ahead.settle(calls)
        return await self.run_many(calls, self._begin, self._finish, self.ahead.take)

    async def release(self, session_id: str) -> bool:
        await self.ahead.drop(session_id)
        if self.local is not None:
            self.local.release(session_id)
        return self.caches.release(session_id)

    def _finish(self, call: VerifyCall, job: _VerifyJob, answer) -> VerifyResult:
        (accepted, extra), ms, batch = answer
        self.stats.fed_tokens += job.feeds + len(job.more)
        self.stats.draft_tokens += len(call.draft_ids) + job.local_drafted
        self.stats.accepted_tokens += accepted + job.local_accepted
        if call.ahead:  # (only a call without drafts may ask: _begin)
            self._decode_ahead(call, job)
        return VerifyResult(num_accepted=accepted, extra_token=extra,
                            cached_len=len(job.entry.tokens), cache_hit=call.cache.base_len > 0,
                            compute_ms=ms, batch_size=batch, logprobs=job.logprobs,
                            more=tuple(job.more), local_drafted=job.local_drafted,
                            local_accepted=job.local_accepted)

    def _decode_ahead(self, call: VerifyCall, job: _VerifyJob) -> None:
        """Starts the session's next plain round, the call ``call.ahead`` names (from the
        last token ``job`` returned), unless that token ends the sequence or the round
        cannot start (the context is full, the queue is)."""
        last = job.last
        if last in self.runner.meta.eos_token_ids:
            return
        entry = job.entry
        base = len(entry.tokens)
        nxt = dataclasses.replace(
            call, cache=CacheDelta(session_id=call.cache.session_id, base_len=base,
                                   base_hash=entry.hasher.hash(entry.tokens, base),
                                   new_tokens=(last,)),
            seed=call.ahead_seed, max_tokens=call.ahead, ahead=0, ahead_seed=0)
        try:
            checkout, ahead_job = self._begin(nxt)
        except Exception as exc:  # noqa: BLE001 - optional work: the next call runs as usual
            log.debug("no decode-ahead for session %s: %s", call.cache.session_id, exc)
            return
        future = self.runner.submit_many([ahead_job])[0]
        if future.done():  # refused (a full queue): the next call runs as usual
            checkout.__exit__(None, None, None)
            future.exception()
            return
        self.ahead.add(Ahead(nxt, checkout, ahead_job, future))

    def _begin(self, call: VerifyCall) -> tuple[AbstractContextManager, _VerifyJob]:
        """Validates ``call`` and checks out its session's cache (ModelEngine.run_many)."""
        delta = call.cache
        try:
            call.params.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        if not 1 <= call.max_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"max_tokens must be in 0..{MAX_TOKENS} (0 or 1: one token), "
                                  f"got {call.max_tokens}")
        if call.max_tokens > 1 and call.draft_ids:
            raise InvalidArgument(f"max_tokens {call.max_tokens} needs a call without drafts: "
                                  "send no draft_token_ids, or max_tokens 0 or 1")
        if not 0 <= call.ahead <= MAX_TOKENS:
            raise InvalidArgument(f"ahead must be in 0..{MAX_TOKENS}, got {call.ahead}")
        if call.ahead and call.draft_ids:
            raise InvalidArgument(f"ahead {call.ahead} (the next round, decoded ahead) needs a "
                                  "call without drafts: send no draft_token_ids, or ahead 0")
        # (the context holds the tokens it feeds: all but the last it returns)
        check_delta(self.runner.meta, delta.session_id, delta.base_len, delta.new_tokens,
                    len(call.draft_ids) + call.max_tokens - 1)
        if not -1 <= call.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got "
                                  f"{call.logprobs}")
        draft = self._sparse_draft(call)
        generator = None if call.params.greedy else torch.Generator().manual_seed(call.seed)
        local = (self.local.k if self.local is not None and call.local and call.max_tokens > 1
                 else 0)
        meta = self.runner.meta
        return self.checked_out(delta, lambda entry, fed: _VerifyJob(
            entry, fed, self.prefill_chunk, call, draft, generator, meta.eos_token_ids,
            local=local, max_context=meta.max_context))


class _VerifyJob(FeedJob):
    """One pass (after the chunks of a long prompt): the pending tokens and the k drafts,
    then the acceptance rule on the last k+1 logits (params and draft were validated before,
    off the model thread). Without drafts, up to ``max_tokens - 1`` more passes, each
    decoding the next token from the last (``more``): of one token each, or, with ``local``
    > 0, of the last token and up to ``local`` drafts of the verifier's own draft model
    where it gives them (``self.local``, set before the pass: verifier_svc/local_drafts.py),
    verified by the same rule."""

    def __init__(self, entry: SessionCache, pending: list[int], chunk: int, call: VerifyCall,
                 draft: SparseDraft, generator: torch.Generator | None,
                 eos: tuple[int, ...] = (), local: int = 0, max_context: int = 0) -> None:
        super().__init__(entry, pending, chunk)
        self.call, self.draft, self.generator = call, draft, generator
        self._eos = eos
        self._local_k, self._max_context = local, max_context
        self.local: SparseDraft | None = None  # the next pass's local drafts
        self.local_drafted = self.local_accepted = 0
        # sampled local drafts draw from their own stream (the acceptance rule's is the call's)
        self.draft_generator = (torch.Generator().manual_seed(call.seed ^ _DRAFT_STREAM)
                                if local and generator is not None else None)
        self._result: tuple[int, int] | None = None
        self.more: list[int] = []  # tokens decoded after the extra token
        self.logprobs: tuple[TokenLogprobs, ...] = ()
        self.limit = call.max_tokens  # tokens to return (a decode-ahead's taker may ask fewer)
        self.beside = call.beside and bool(call.draft_ids)  # a tree runs beside its pass
        self._stopped = False

    @property
    def done(self) -> bool:
        if self._stopped:
            return True
        if self._result is None:
            return False
        return 1 + len(self.more) >= self.limit or self.last in self._eos

    @property
    def last(self) -> int:
        """The last token decoded (once the first pass is done)."""
        return self.more[-1] if self.more else self._result[1]

    @property
    def session_id(self) -> str:
        return self.call.cache.session_id

    @property
    def produced(self) -> int:
        """Tokens decoded so far (the call's accepted drafts among them)."""
        return 0 if self._result is None else self._result[0] + 1 + len(self.more)

    def wants_drafts(self) -> int:
        """How many local drafts the next pass can verify: 0 once done, for a pass that
        feeds a chunk of a long prompt, and where fewer than two tokens are still wanted;
        else up to ``local``, within the tokens wanted and the context."""
        if not self._local_k or self.done:
            return 0
        if self._result is None and (not self.pending or 0 < self.chunk < len(self.pending)):
            return 0
        wanted = self.limit - (0 if self._result is None else 1 + len(self.more))
        room = self._max_context - len(self.entry.tokens) - self.feeding
        return max(0, min(self._local_k, wanted - 1, room))

    @property
    def feeding(self) -> int:
        """Tokens of the session's own the next pass feeds (a prompt's, or one)."""
        return len(self.pending) if self._result is None else 1

    def draft_context(self) -> list[int]:
        """The session's tokens once the next pass fed its own: what drafts continue."""
        fed = self.pending if self._result is None else [self.last]
        return [*self.entry.tokens, *fed]

    def stop(self) -> None:
        """Ends the job at its next pass (a decode-ahead no call takes: its tokens stay
        uncommitted in the cache, which the session's next call crops)."""
        self._stopped = True

    def limit_to(self, tokens: int) -> None:
        """Returns at most ``tokens`` tokens (a decode-ahead taken by a call that asks for
        fewer): a running job ends there; one that went further is trimmed by ``trim``."""
        self.limit = min(self.limit, tokens)

    def trim(self) -> None:
        """Drops the tokens decoded past ``limit`` and the cache positions they were fed on.
        Only while the job is off the model thread (its future settled, or settling), its
        checkout still held."""
        drop = 1 + len(self.more) - self.limit if self._result is not None else 0
        if drop <= 0:
            return
        del self.more[len(self.more) - drop:]
        self.entry.crop(len(self.entry.tokens) - drop)
        if self.logprobs:
            self.logprobs = self.logprobs[: self._result[0] + self.limit]

    def row(self) -> Row:
        if self._result is not None:  # the next token, from the last one (and local drafts)
            drafts = self.local.token_ids.tolist() if self.local is not None else []
            return self.row_of([self.last, *drafts], keep=1 + len(drafts))
        drafts = (list(self.call.draft_ids) if self.local is None
                  else self.local.token_ids.tolist())
        return self.row_of(self.pending + drafts, keep=len(drafts) + 1)

    def use(self, logits: torch.Tensor) -> None:  # logits [k+1, V]
        if self._result is not None:
            self._next(logits)
            return
        drafts, self.local = self.local, None
        if drafts is not None:  # (a call without drafts: the local ones)
            new = self._drafted(logits, self.pending, drafts)
            self._result, self.more = (0, new[0]), new[1:]
            return
        accepted, extra = self._accept(logits, self.pending, self.draft)
        self._result = (accepted, extra)
        if self.call.logprobs >= 0:
            self.logprobs = _logprobs(logits[: accepted + 1],
                                      [*self.call.draft_ids[:accepted], extra], self.call.logprobs)

    def _next(self, logits: torch.Tensor) -> None:  # logits [1 + k, V]: the token fed, drafts
        drafts, self.local = self.local, None
        if drafts is not None:
            self.more.extend(self._drafted(logits, [self.last], drafts))
            return
        _, token = self._accept(logits, [self.last], self.draft)  # (the call's: no drafts)
        self.more.append(token)
        if self.call.logprobs >= 0:
            self.logprobs += _logprobs(logits, [token], self.call.logprobs)

    def _accept(self, logits: torch.Tensor, fed: Sequence[int], draft: SparseDraft
                ) -> tuple[int, int]:
        """The acceptance rule on a pass that fed ``fed`` and ``draft``'s tokens (none: a
        token of the target's own): (accepted, the target's token); the cache keeps ``fed``
        and the accepted drafts. logits [1 + k, V]."""
        entry, params = self.entry, self.call.params
        start = len(entry.tokens) + len(fed)
        entry.tokens.extend(fed)
        entry.tokens.extend(draft.token_ids.tolist())
        if params.greedy:
            accepted, extra = accept_greedy(draft.token_ids, logits)
        else:
            accepted, extra = accept_sampled(draft, warp_logits(logits, params), self.generator)
        entry.crop(start + accepted)
        return accepted, extra

    def _drafted(self, logits: torch.Tensor, fed: list[int], drafts: SparseDraft
                 ) -> list[int]:
        """The acceptance rule on a pass that fed ``fed`` (the call's tokens, or the last
        token) and k local drafts: returns the tokens decoded, the accepted drafts and the
        target's own token, up to an end-of-sequence token; the cache keeps what was fed
        of them (all but the last)."""
        accepted, extra = self._accept(logits, fed, drafts)
        ids = drafts.token_ids.tolist()  # [k]
        new = [*ids[:accepted], extra]
        end = next((i for i, t in enumerate(new) if t in self._eos), None)
        if end is not None:  # the cache keeps the drafts fed before it, not those after
            self.entry.crop(len(self.entry.tokens) - (len(new) - 1 - end))
            new = new[: end + 1]
        self.local_drafted += len(ids)
        self.local_accepted += accepted
        if self.call.logprobs >= 0:
            self.logprobs += _logprobs(logits[: len(new)], new, self.call.logprobs)
        return new

    def result(self) -> tuple[int, int] | None:
        """(accepted, extra token); None for a decode-ahead stopped before its first pass."""
        self.trim()  # (a decode-ahead's taker asked for fewer while it ran)
        return self._result


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> tuple[TokenLogprobs, ...]:
    """Each token's log-probability under the target's raw logits (log_softmax at
    temperature 1, before any warping: the same with and without speculation) and the
    ``top`` most likely tokens at its position. logits [n, V] for n tokens."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [n, V]
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device).unsqueeze(-1)  # [n, 1]
    chosen = logp.gather(-1, index).squeeze(-1).tolist()  # [n]
    top = min(top, logp.shape[-1])
    best_ids, best_lp = ([[]] * len(tokens), [[]] * len(tokens))
    if top:
        best = torch.topk(logp, top, dim=-1)  # [n, top]
        best_ids, best_lp = best.indices.tolist(), best.values.tolist()
    return tuple(TokenLogprobs(token_id=t, logprob=chosen[i], top_ids=tuple(best_ids[i]),
                               top_logprobs=tuple(best_lp[i]))
                 for i, t in enumerate(tokens))
