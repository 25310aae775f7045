"""Protobuf <-> dataclass conversion for the internal drafter and verifier calls.

Used only at the edges: the servicers and the gateway's clients.
"""

from __future__ import annotations

from services.messages import (
    Branch,
    CacheDelta,
    DraftCall,
    DraftResult,
    ReplicaStats,
    SpeculateCall,
    SpeculateResult,
    TokenLogprobs,
    VerifyCall,
    VerifyResult,
)
from services.model_info import ModelMeta
from services.params import SamplingParams
from specmesh.v1 import common_pb2, drafter_pb2, verifier_pb2


def delta_to_pb(d: CacheDelta) -> common_pb2.CacheDelta:
    return common_pb2.CacheDelta(session_id=d.session_id, base_len=d.base_len,
                                 base_hash=d.base_hash, new_tokens=d.new_tokens)


def delta_from_pb(m: common_pb2.CacheDelta) -> CacheDelta:
    return CacheDelta(session_id=m.session_id, base_len=m.base_len, base_hash=m.base_hash,
                      new_tokens=tuple(m.new_tokens))


def warp_to_pb(params: SamplingParams, seed: int) -> common_pb2.WarpParams:
    return common_pb2.WarpParams(temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, seed=seed)


def warp_from_pb(m: common_pb2.WarpParams) -> tuple[SamplingParams, int]:
    top_p = m.top_p if m.top_p != 0 else 1.0
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=top_p), m.seed


def _dists(ids, probs) -> list[common_pb2.SparseDist]:
    return [common_pb2.SparseDist(token_ids=i, probs=p) for i, p in zip(ids, probs, strict=True)]


def draft_call_to_pb(c: DraftCall) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(cache=delta_to_pb(c.cache), num_tokens=c.num_tokens,
                                    warp=warp_to_pb(c.params, c.seed), max_support=c.max_support)


def draft_call_from_pb(m: drafter_pb2.DraftRequest) -> DraftCall:
    params, seed = warp_from_pb(m.warp)
    return DraftCall(cache=delta_from_pb(m.cache), num_tokens=m.num_tokens, params=params,
                     seed=seed, max_support=m.max_support)


def draft_result_to_pb(r: DraftResult) -> drafter_pb2.DraftResponse:
    return drafter_pb2.DraftResponse(token_ids=r.token_ids, dists=_dists(r.q_ids, r.q_probs),
                                     cached_len=r.cached_len, cache_hit=r.cache_hit,
                                     compute_ms=r.compute_ms, batch_size=r.batch_size)


def draft_result_from_pb(m: drafter_pb2.DraftResponse) -> DraftResult:
    return DraftResult(token_ids=tuple(m.token_ids),
                       q_ids=tuple(tuple(d.token_ids) for d in m.dists),
                       q_probs=tuple(tuple(d.probs) for d in m.dists),
                       cached_len=m.cached_len, cache_hit=m.cache_hit, compute_ms=m.compute_ms,
                       batch_size=max(1, m.batch_size))


def speculate_call_to_pb(c: SpeculateCall) -> drafter_pb2.SpeculateRequest:
    return drafter_pb2.SpeculateRequest(
        cache=delta_to_pb(c.cache), num_drafts=c.num_drafts, num_tokens=c.num_tokens,
        warp=warp_to_pb(c.params, c.seed), max_support=c.max_support,
        max_branches=c.max_branches, acceptance=c.acceptance, coverage=c.coverage)


def speculate_call_from_pb(m: drafter_pb2.SpeculateRequest) -> SpeculateCall:
    params, seed = warp_from_pb(m.warp)
    return SpeculateCall(cache=delta_from_pb(m.cache), num_drafts=m.num_drafts,
                         num_tokens=m.num_tokens, params=params, seed=seed,
                         max_support=m.max_support, max_branches=m.max_branches,
                         acceptance=m.acceptance, coverage=m.coverage or 0.95)


def speculate_result_to_pb(r: SpeculateResult) -> drafter_pb2.SpeculateResponse:
    return drafter_pb2.SpeculateResponse(
        branches=[drafter_pb2.SpeculationBranch(
            accepted=b.accepted, token=b.token, token_ids=b.draft.token_ids,
            dists=_dists(b.draft.q_ids, b.draft.q_probs), probability=b.probability)
            for b in r.branches],
        cached_len=r.cached_len, cache_hit=r.cache_hit, compute_ms=r.compute_ms,
        batch_size=r.batch_size)


def speculate_result_from_pb(m: drafter_pb2.SpeculateResponse) -> SpeculateResult:
    branches = tuple(Branch(
        accepted=b.accepted, token=b.token, probability=b.probability,
        draft=DraftResult(token_ids=tuple(b.token_ids),
                          q_ids=tuple(tuple(d.token_ids) for d in b.dists),
                          q_probs=tuple(tuple(d.probs) for d in b.dists),
                          cached_len=m.cached_len, cache_hit=m.cache_hit,
                          compute_ms=m.compute_ms)) for b in m.branches)
    return SpeculateResult(branches=branches, cached_len=m.cached_len, cache_hit=m.cache_hit,
                           compute_ms=m.compute_ms, batch_size=max(1, m.batch_size))


def verify_call_to_pb(c: VerifyCall) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(cache=delta_to_pb(c.cache), draft_token_ids=c.draft_ids,
                                      draft_dists=_dists(c.q_ids, c.q_probs),
                                      warp=warp_to_pb(c.params, c.seed),
                                      logprobs=c.logprobs >= 0,
                                      top_logprobs=max(0, c.logprobs),
                                      max_tokens=c.max_tokens if c.max_tokens > 1 else 0,
                                      ahead=c.ahead, ahead_seed=c.ahead_seed,
                                      drafting_beside=c.beside, local_drafts=c.local)


def verify_call_from_pb(m: verifier_pb2.VerifyRequest) -> VerifyCall:
    params, seed = warp_from_pb(m.warp)
    return VerifyCall(cache=delta_from_pb(m.cache), draft_ids=tuple(m.draft_token_ids),
                      q_ids=tuple(tuple(d.token_ids) for d in m.draft_dists),
                      q_probs=tuple(tuple(d.probs) for d in m.draft_dists),
                      params=params, seed=seed,
                      logprobs=m.top_logprobs if m.logprobs else -1,
                      max_tokens=max(1, m.max_tokens), ahead=m.ahead, ahead_seed=m.ahead_seed,
                      beside=m.drafting_beside, local=m.local_drafts)


def verify_result_to_pb(r: VerifyResult) -> verifier_pb2.VerifyResponse:
    return verifier_pb2.VerifyResponse(
        num_accepted=r.num_accepted, extra_token_id=r.extra_token, cached_len=r.cached_len,
        cache_hit=r.cache_hit, compute_ms=r.compute_ms, batch_size=r.batch_size,
        more_token_ids=r.more,
        logprobs=[verifier_pb2.VerifiedLogprob(token_id=t.token_id, logprob=t.logprob,
                                               top_token_ids=t.top_ids,
                                               top_logprobs=t.top_logprobs)
                  for t in r.logprobs])


def verify_result_from_pb(m: verifier_pb2.VerifyResponse) -> VerifyResult:
    return VerifyResult(num_accepted=m.num_accepted, extra_token=m.extra_token_id,
                        cached_len=m.cached_len, cache_hit=m.cache_hit, compute_ms=m.compute_ms,
                        batch_size=max(1, m.batch_size), more=tuple(m.more_token_ids),
                        logprobs=tuple(TokenLogprobs(token_id=t.token_id, logprob=t.logprob,
                                                     top_ids=tuple(t.top_token_ids),
                                                     top_logprobs=tuple(t.top_logprobs))
                                       for t in m.logprobs))


def meta_to_pb(meta: ModelMeta, kind: str, max_draft_tokens: int,
               prefix_block_size: int = 0) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(model=meta.model, fingerprint=meta.fingerprint,
                                vocab_hash=meta.vocab_hash, vocab_size=meta.vocab_size,
                                max_context=meta.max_context, eos_token_ids=meta.eos_token_ids,
                                kind=kind, max_draft_tokens=max_draft_tokens,
                                prefix_block_size=prefix_block_size)


def stats_to_pb(s: ReplicaStats, caches, queue_depth: int) -> common_pb2.ReplicaStats:
    """``caches``: the replica's SessionCaches (sessions, evictions, prefills, resyncs)."""
    return common_pb2.ReplicaStats(
        sessions=len(caches), calls=s.calls, fresh_prefills=caches.fresh_prefills,
        resyncs_requested=caches.resyncs_requested, fed_tokens=s.fed_tokens,
        draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        evictions=caches.evictions, queue_depth=queue_depth, kv_tokens=caches.total_tokens(),
        kv_token_budget=caches.max_tokens or 0, forward_ms=s.forward_ms,
        forward_passes=s.forward_passes, batched_calls=s.batched_calls,
        ahead_started=s.ahead_started, ahead_taken=s.ahead_taken,
        **_prefix_stats(caches.prefix))


def _prefix_stats(prefix) -> dict:
    """The ReplicaStats fields of a replica's prefix cache (None: off)."""
    if prefix is None:
        return {}
    p = prefix.stats
    return dict(prefix_lookups=p.lookups, prefix_hits=p.hits, prefix_lookup_tokens=p.lookup_tokens,
                prefix_hit_tokens=p.hit_tokens, prefix_blocks=len(prefix),
                prefix_block_budget=prefix.max_blocks, prefix_evicted_blocks=p.evicted_blocks,
                prefix_block_size=prefix.block)
