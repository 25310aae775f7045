"""The drafter and verifier called directly over gRPC: they must not trust the gateway.

Reference values come from the tiny HF models themselves (forward passes and
generate), never from SpecMesh code.
"""

from __future__ import annotations

import math
import re
import uuid

import grpc
import pytest
import torch

from services.hashing import token_hash
from specmesh.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.conftest import hf_greedy

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
TIMEOUT = 30
RESYNC = ("specmesh-resync", "required")


# --------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def verifier(mesh):
    with grpc.insecure_channel(mesh.verifier_addresses[0]) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)


@pytest.fixture(scope="module")
def drafter(mesh):
    with grpc.insecure_channel(mesh.drafter_addresses[0]) as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)


@pytest.fixture(scope="module")
def prompt_ids(target_model) -> list[int]:
    ids = target_model[1](PROMPT)["input_ids"]
    assert len(ids) >= 8
    return ids


@pytest.fixture(scope="module")
def greedy(target_model, prompt_ids) -> list[int]:
    """The target's own greedy continuation of PROMPT (HF generate)."""
    return hf_greedy(target_model[0], prompt_ids, 10)


@pytest.fixture(scope="module")
def vinfo(verifier):
    return verifier.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def dinfo(drafter):
    return drafter.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=TIMEOUT)


def sid() -> str:
    return f"t-{uuid.uuid4().hex}"


def hf_next(model, ids: list[int]) -> int:
    """argmax of the HF model's next-token logits after ``ids`` (one plain forward)."""
    with torch.inference_mode():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def delta(session: str, base: list[int], new: list[int], base_len: int | None = None,
          base_hash: int | None = None) -> common_pb2.CacheDelta:
    return common_pb2.CacheDelta(
        session_id=session, base_len=len(base) if base_len is None else base_len,
        base_hash=token_hash(base) if base_hash is None else base_hash, new_tokens=new)


def warp(temperature=0.0, top_k=0, top_p=1.0, seed=0) -> common_pb2.WarpParams:
    return common_pb2.WarpParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def vreq(session, base, new, drafts=(), dists=(), **warp_kw) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(cache=delta(session, base, new), draft_token_ids=drafts,
                                      draft_dists=dists, warp=warp(**warp_kw))


def dreq(session, base, new, num_tokens=4, max_support=8, **warp_kw) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(cache=delta(session, base, new), num_tokens=num_tokens,
                                    warp=warp(**warp_kw), max_support=max_support)


def dist(ids, probs) -> common_pb2.SparseDist:
    return common_pb2.SparseDist(token_ids=ids, probs=probs)


def vstats(verifier) -> common_pb2.ReplicaStats:
    return verifier.GetStats(common_pb2.StatsRequest(), timeout=TIMEOUT)


def dstats(drafter) -> common_pb2.ReplicaStats:
    return drafter.GetStats(common_pb2.StatsRequest(), timeout=TIMEOUT)


def expect_error(call, request, code) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=TIMEOUT)
    assert err.value.code() == code, (err.value.code(), err.value.details())
    return err.value


def expect_resync(call, request) -> grpc.RpcError:
    err = expect_error(call, request, grpc.StatusCode.FAILED_PRECONDITION)
    metadata = tuple((m.key, m.value) for m in err.trailing_metadata() or ())
    assert RESYNC in metadata, metadata
    return err


def other_token(token: int, vocab: int) -> int:
    return (token + 7) % vocab


# --------------------------------------------------------------------------- model info


def test_model_info_matches_the_model_configs(vinfo, dinfo, tiny_pair):
    from transformers import AutoConfig, GenerationConfig

    for info, path in ((vinfo, tiny_pair[0]), (dinfo, tiny_pair[1])):
        config = AutoConfig.from_pretrained(path)
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        assert info.vocab_size == config.vocab_size
        assert info.max_context == config.max_position_embeddings
        assert list(info.eos_token_ids) == eos
        assert info.model == path
        assert info.max_draft_tokens >= 1
        assert info.fingerprint
    assert vinfo.vocab_hash and vinfo.vocab_hash == dinfo.vocab_hash
    assert vinfo.fingerprint != dinfo.fingerprint, "target and draft weights differ"


# --------------------------------------------------------------------------- verifier: greedy


def test_verify_without_drafts_gives_target_argmax(verifier, target_model, prompt_ids):
    reply = verifier.Verify(vreq(sid(), [], prompt_ids), timeout=TIMEOUT)
    assert reply.extra_token_id == hf_next(target_model[0], prompt_ids)
    assert reply.num_accepted == 0
    assert reply.cached_len == len(prompt_ids)
    assert not reply.cache_hit


@pytest.mark.parametrize("k", [1, 3, 6])
def test_verify_accepts_the_targets_own_greedy_continuation(verifier, prompt_ids, greedy, k):
    reply = verifier.Verify(vreq(sid(), [], prompt_ids, drafts=greedy[:k]), timeout=TIMEOUT)
    assert reply.num_accepted == k
    assert reply.extra_token_id == greedy[k]
    assert reply.cached_len == len(prompt_ids) + k


def test_verify_rejects_a_wrong_first_draft(verifier, vinfo, prompt_ids, greedy):
    drafts = [other_token(greedy[0], vinfo.vocab_size), *greedy[1:4]]
    reply = verifier.Verify(vreq(sid(), [], prompt_ids, drafts=drafts), timeout=TIMEOUT)
    assert reply.num_accepted == 0
    assert reply.extra_token_id == greedy[0]
    assert reply.cached_len == len(prompt_ids)


def test_verify_accepts_exactly_the_matching_prefix(verifier, vinfo, prompt_ids, greedy):
    drafts = [*greedy[:2], other_token(greedy[2], vinfo.vocab_size), greedy[3]]
    reply = verifier.Verify(vreq(sid(), [], prompt_ids, drafts=drafts), timeout=TIMEOUT)
    assert reply.num_accepted == 2
    assert reply.extra_token_id == greedy[2]
    assert reply.cached_len == len(prompt_ids) + 2


# --------------------------------------------------------------------------- verifier: deltas


def test_delta_continues_the_cache_and_feeds_only_new_tokens(verifier, vinfo, prompt_ids, greedy):
    s = sid()
    drafts = [*greedy[:2], other_token(greedy[2], vinfo.vocab_size)]
    r1 = verifier.Verify(vreq(s, [], prompt_ids, drafts=drafts), timeout=TIMEOUT)
    assert (r1.num_accepted, r1.extra_token_id) == (2, greedy[2])
    committed = prompt_ids + greedy[:3]  # accepted drafts + the extra token

    before = vstats(verifier)
    base = committed[: r1.cached_len]
    r2 = verifier.Verify(vreq(s, base, committed[r1.cached_len:], drafts=greedy[3:5]),
                         timeout=TIMEOUT)
    after = vstats(verifier)
    assert r2.cache_hit
    assert r2.num_accepted == 2 and r2.extra_token_id == greedy[5]
    assert r2.cached_len == len(committed) + 2
    assert after.fed_tokens - before.fed_tokens == 1
    assert after.calls - before.calls == 1
    assert after.fresh_prefills == before.fresh_prefills
    assert after.draft_tokens - before.draft_tokens == 2
    assert after.accepted_tokens - before.accepted_tokens == 2


def test_delta_can_roll_back_to_a_shorter_committed_prefix(verifier, target_model, prompt_ids,
                                                           greedy):
    """A cache holding more than base_len tokens (e.g. drafts of a round the gateway
    abandoned) is cropped to the named prefix, not resynced and not reused wrongly."""
    s = sid()
    r1 = verifier.Verify(vreq(s, [], prompt_ids, drafts=greedy[:4]), timeout=TIMEOUT)
    assert r1.cached_len == len(prompt_ids) + 4
    base = prompt_ids[:-3]
    r2 = verifier.Verify(vreq(s, base, prompt_ids[-3:], drafts=greedy[:2]), timeout=TIMEOUT)
    assert r2.cache_hit
    assert (r2.num_accepted, r2.extra_token_id) == (2, greedy[2])
    assert r2.cached_len == len(prompt_ids) + 2
    # And once more after that rollback, with a token the target would not pick.
    seq = prompt_ids + greedy[:2] + [5]
    r3 = verifier.Verify(vreq(s, seq[: r2.cached_len], seq[r2.cached_len:]), timeout=TIMEOUT)
    assert r3.cache_hit
    assert r3.extra_token_id == hf_next(target_model[0], seq)


def test_wrong_hash_or_too_long_base_needs_resync_and_corrupts_nothing(verifier, target_model,
                                                                       prompt_ids, greedy):
    s = sid()
    r1 = verifier.Verify(vreq(s, [], prompt_ids, drafts=greedy[:2]), timeout=TIMEOUT)
    cached = prompt_ids + greedy[:2]
    assert r1.cached_len == len(cached)
    before = vstats(verifier)

    bad_hash = verifier_pb2.VerifyRequest(
        cache=delta(s, cached, [greedy[2]], base_hash=token_hash(cached) ^ 1))
    expect_resync(verifier.Verify, bad_hash)
    too_long = verifier_pb2.VerifyRequest(cache=delta(s, cached + [greedy[2]], [greedy[3]]))
    expect_resync(verifier.Verify, too_long)
    # Same length, different content (a hash over other tokens).
    other = verifier_pb2.VerifyRequest(cache=delta(s, [*cached[:-1], cached[-1] + 1], [greedy[2]]))
    expect_resync(verifier.Verify, other)

    after = vstats(verifier)
    assert after.resyncs_requested - before.resyncs_requested == 3
    assert after.fed_tokens == before.fed_tokens

    # The cache was left intact: the correct delta still hits and is right.
    r2 = verifier.Verify(vreq(s, cached, [greedy[2]]), timeout=TIMEOUT)
    assert r2.cache_hit
    assert r2.extra_token_id == greedy[3] == hf_next(target_model[0], cached + [greedy[2]])
    assert r2.cached_len == len(cached) + 1
    # And a resync with base_len = 0 gives the fresh computation.
    full = prompt_ids + greedy[:4]
    r3 = verifier.Verify(vreq(s, [], full), timeout=TIMEOUT)
    assert not r3.cache_hit
    assert r3.extra_token_id == hf_next(target_model[0], full)
    assert r3.cached_len == len(full)


def test_unknown_session_with_base_needs_resync(verifier, drafter, prompt_ids):
    s = sid()
    expect_resync(verifier.Verify, vreq(s, prompt_ids[:4], prompt_ids[4:]))
    expect_resync(drafter.Draft, dreq(s, prompt_ids[:4], prompt_ids[4:]))


def test_release_frees_the_session(verifier, drafter, prompt_ids):
    s = sid()
    verifier.Verify(vreq(s, [], prompt_ids), timeout=TIMEOUT)
    drafter.Draft(dreq(s, [], prompt_ids, num_tokens=2), timeout=TIMEOUT)
    sessions_before = vstats(verifier).sessions
    for stub in (verifier, drafter):
        first = stub.Release(common_pb2.ReleaseRequest(session_id=s), timeout=TIMEOUT)
        second = stub.Release(common_pb2.ReleaseRequest(session_id=s), timeout=TIMEOUT)
        assert (first.released, second.released) == (True, False)
    assert vstats(verifier).sessions == sessions_before - 1
    # A released session's cache is gone: continuing it needs a resync.
    expect_resync(verifier.Verify, vreq(s, prompt_ids, [1]))
    expect_resync(drafter.Draft, dreq(s, prompt_ids, [1]))
    for stub in (verifier, drafter):
        expect_error(stub.Release, common_pb2.ReleaseRequest(session_id=""),
                     grpc.StatusCode.INVALID_ARGUMENT)


# --------------------------------------------------------------------------- hostile input


def _long(n: int) -> list[int]:
    return [(7 * i + 3) % 300 + 10 for i in range(n)]


# name -> (function (session, prompt, info) -> VerifyRequest, regex the message must match)
VERIFY_HOSTILE = {
    "oov_new_token": (lambda s, p, i: vreq(s, [], [*p, i.vocab_size]), r"new_tokens"),
    "negative_new_token": (lambda s, p, i: vreq(s, [], [*p[:-1], -1]), r"new_tokens"),
    "empty_new_tokens": (lambda s, p, i: vreq(s, p, []), r"new_tokens"),
    "empty_session_id": (lambda s, p, i: vreq("", [], p), r"session_id"),
    "long_session_id": (lambda s, p, i: vreq("x" * 129, [], p), r"session_id"),
    "nonprintable_session_id": (lambda s, p, i: vreq("a\nb", [], p), r"session_id"),
    "too_many_drafts": (lambda s, p, i: vreq(s, [], p, drafts=[5] * (i.max_draft_tokens + 1)),
                        r"draft"),
    "oov_draft_token": (lambda s, p, i: vreq(s, [], p, drafts=[5, i.vocab_size]), r"draft"),
    "negative_draft_token": (lambda s, p, i: vreq(s, [], p, drafts=[-3]), r"draft"),
    "sampling_missing_dists": (lambda s, p, i: vreq(s, [], p, drafts=[5, 6], temperature=1.0),
                               r"draft.?dist"),
    "sampling_too_few_dists": (lambda s, p, i: vreq(s, [], p, drafts=[5, 6],
                                                    dists=[dist([5], [1.0])], temperature=1.0),
                               r"draft.?dist"),
    "sampling_ids_probs_mismatch": (lambda s, p, i: vreq(s, [], p, drafts=[5],
                                                         dists=[dist([5, 6], [1.0])],
                                                         temperature=1.0),
                                    r"draft.?dist|probs"),
    "sampling_empty_dist": (lambda s, p, i: vreq(s, [], p, drafts=[5], dists=[dist([], [])],
                                                 temperature=1.0), r"draft.?dist|probs|support"),
    "q_not_summing_to_one": (lambda s, p, i: vreq(s, [], p, drafts=[5],
                                                  dists=[dist([5, 6], [0.5, 0.2])],
                                                  temperature=1.0), r"q_probs|sum"),
    "q_negative": (lambda s, p, i: vreq(s, [], p, drafts=[5], dists=[dist([5, 6], [1.5, -0.5])],
                                        temperature=1.0), r"q_probs|probs"),
    "q_nan": (lambda s, p, i: vreq(s, [], p, drafts=[5], dists=[dist([5, 6], [math.nan, 1.0])],
                                   temperature=1.0), r"q_probs|probs"),
    "q_oov_support": (lambda s, p, i: vreq(s, [], p, drafts=[5],
                                           dists=[dist([5, i.vocab_size], [0.5, 0.5])],
                                           temperature=1.0), r"q_ids|support|vocab"),
    "draft_not_in_support": (lambda s, p, i: vreq(s, [], p, drafts=[5], dists=[dist([6], [1.0])],
                                                  temperature=1.0), r"support|q = 0"),
    "negative_temperature": (lambda s, p, i: vreq(s, [], p, temperature=-0.5), r"temperature"),
    "nan_temperature": (lambda s, p, i: vreq(s, [], p, temperature=math.nan), r"temperature"),
    "inf_temperature": (lambda s, p, i: vreq(s, [], p, temperature=math.inf), r"temperature"),
    "top_p_above_one": (lambda s, p, i: vreq(s, [], p, temperature=1.0, top_p=1.5), r"top_p"),
    "negative_top_p": (lambda s, p, i: vreq(s, [], p, temperature=1.0, top_p=-0.1), r"top_p"),
    "negative_top_k": (lambda s, p, i: vreq(s, [], p, temperature=1.0, top_k=-1), r"top_k"),
    "longer_than_context": (lambda s, p, i: vreq(s, [], _long(i.max_context + 1)), r"context"),
    "context_with_drafts": (lambda s, p, i: vreq(s, [], _long(i.max_context - 1), drafts=[5, 6]),
                            r"context"),
    "huge_base_len": (lambda s, p, i: verifier_pb2.VerifyRequest(
        cache=delta(s, p, [5], base_len=2**32 - 1)), r"context"),
}


def _assert_session_intact(verifier, target_model, s, prompt_ids):
    """The session built before a hostile call still continues with a cache hit."""
    seq = prompt_ids + [11]
    reply = verifier.Verify(vreq(s, prompt_ids, [11]), timeout=TIMEOUT)
    assert reply.cache_hit
    assert reply.extra_token_id == hf_next(target_model[0], seq)
    assert reply.cached_len == len(seq)


@pytest.mark.parametrize("case", sorted(VERIFY_HOSTILE))
def test_verifier_rejects_hostile_input(verifier, vinfo, target_model, prompt_ids, case):
    build, pattern = VERIFY_HOSTILE[case]
    s = sid()
    r0 = verifier.Verify(vreq(s, [], prompt_ids), timeout=TIMEOUT)
    assert r0.cached_len == len(prompt_ids)
    before = vstats(verifier)
    err = expect_error(verifier.Verify, build(s, prompt_ids, vinfo),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert re.search(pattern, err.details() or "", re.IGNORECASE), err.details()
    after = vstats(verifier)
    assert after.calls - before.calls == 1, "rejected calls are counted"
    assert after.fed_tokens == before.fed_tokens
    _assert_session_intact(verifier, target_model, s, prompt_ids)


DRAFT_HOSTILE = {
    "zero_tokens": (lambda s, p, i: dreq(s, [], p, num_tokens=0), r"num_tokens"),
    "negative_tokens": (lambda s, p, i: dreq(s, [], p, num_tokens=-2), r"num_tokens"),
    "too_many_tokens": (lambda s, p, i: dreq(s, [], p, num_tokens=i.max_draft_tokens + 1),
                        r"num_tokens"),
    "zero_support": (lambda s, p, i: dreq(s, [], p, max_support=0), r"max_support"),
    "support_above_256": (lambda s, p, i: dreq(s, [], p, max_support=257), r"max_support"),
    "oov_new_token": (lambda s, p, i: dreq(s, [], [*p, i.vocab_size]), r"new_tokens"),
    "negative_new_token": (lambda s, p, i: dreq(s, [], [-5, *p]), r"new_tokens"),
    "empty_new_tokens": (lambda s, p, i: dreq(s, p, []), r"new_tokens"),
    "empty_session_id": (lambda s, p, i: dreq("", [], p), r"session_id"),
    "negative_temperature": (lambda s, p, i: dreq(s, [], p, temperature=-1.0), r"temperature"),
    "nan_temperature": (lambda s, p, i: dreq(s, [], p, temperature=math.nan), r"temperature"),
    "top_p_above_one": (lambda s, p, i: dreq(s, [], p, temperature=1.0, top_p=2.0), r"top_p"),
    "negative_top_k": (lambda s, p, i: dreq(s, [], p, temperature=1.0, top_k=-3), r"top_k"),
    "longer_than_context": (lambda s, p, i: dreq(s, [], _long(i.max_context - 1), num_tokens=4),
                            r"context"),
}


@pytest.mark.parametrize("case", sorted(DRAFT_HOSTILE))
def test_drafter_rejects_hostile_input(drafter, dinfo, draft_model, prompt_ids, case):
    build, pattern = DRAFT_HOSTILE[case]
    s = sid()
    r0 = drafter.Draft(dreq(s, [], prompt_ids, num_tokens=2), timeout=TIMEOUT)
    assert r0.cached_len == len(prompt_ids) + 1
    before = dstats(drafter)
    err = expect_error(drafter.Draft, build(s, prompt_ids, dinfo),
                       grpc.StatusCode.INVALID_ARGUMENT)
    assert re.search(pattern, err.details() or "", re.IGNORECASE), err.details()
    after = dstats(drafter)
    assert after.calls - before.calls == 1
    assert after.fed_tokens == before.fed_tokens
    # The session is intact and the drafter still answers correctly.
    reply = drafter.Draft(dreq(s, prompt_ids, [11], num_tokens=2), timeout=TIMEOUT)
    assert reply.cache_hit
    assert list(reply.token_ids) == hf_greedy(draft_model, prompt_ids + [11], 2)


def test_drafter_accepts_the_boundaries(drafter, dinfo, draft_model, prompt_ids):
    """max_draft_tokens and max_support 256 are allowed (the limits are inclusive)."""
    n = dinfo.max_draft_tokens
    reply = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=n, max_support=256),
                          timeout=TIMEOUT)
    assert list(reply.token_ids) == hf_greedy(draft_model, prompt_ids, n)
    reply = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=1, max_support=1,
                               temperature=1.0, seed=3), timeout=TIMEOUT)
    assert len(reply.token_ids) == 1 and len(reply.dists[0].token_ids) == 1
    assert reply.token_ids[0] == int(hf_logits(draft_model, prompt_ids).argmax())


# --------------------------------------------------------------------------- verifier: sampling


def test_verify_sampling_with_drafter_dists(verifier, drafter, prompt_ids):
    """Temperature > 0 with the drafter's own q: a valid call whose result follows the
    protocol's invariants and is reproducible for a seed."""
    warp_kw = dict(temperature=0.8, top_k=20, seed=1234)
    d = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=4, max_support=16, **warp_kw),
                      timeout=TIMEOUT)
    replies = []
    for _ in range(2):
        replies.append(verifier.Verify(
            vreq(sid(), [], prompt_ids, drafts=d.token_ids, dists=d.dists, **warp_kw),
            timeout=TIMEOUT))
    r = replies[0]
    assert 0 <= r.num_accepted <= 4
    assert r.cached_len == len(prompt_ids) + r.num_accepted
    assert (r.num_accepted, r.extra_token_id) == (replies[1].num_accepted,
                                                  replies[1].extra_token_id)


def test_sampling_with_top_k_1_is_greedy(verifier, drafter, vinfo, prompt_ids, greedy):
    """top_k = 1 makes both p and q one-hot: speculative sampling must then accept exactly
    the drafts that match the target's greedy choice, whatever the seed."""
    kw = dict(temperature=1.0, top_k=1)
    r0 = verifier.Verify(vreq(sid(), [], prompt_ids, seed=5, **kw), timeout=TIMEOUT)
    assert (r0.num_accepted, r0.extra_token_id) == (0, greedy[0])
    d = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=6, max_support=4, seed=9, **kw),
                      timeout=TIMEOUT)
    assert all(len(x.token_ids) == 1 and list(x.probs) == [1.0] for x in d.dists)
    matching = 0
    while matching < 6 and d.token_ids[matching] == greedy[matching]:
        matching += 1
    for seed in (1, 2, 3):
        r = verifier.Verify(vreq(sid(), [], prompt_ids, drafts=d.token_ids, dists=d.dists,
                                 seed=seed, **kw), timeout=TIMEOUT)
        assert r.num_accepted == matching
        assert r.extra_token_id == greedy[matching]
        assert r.cached_len == len(prompt_ids) + matching
    # The target's own greedy tokens with one-hot q are all accepted.
    own = [dist([t], [1.0]) for t in greedy[:4]]
    r = verifier.Verify(vreq(sid(), [], prompt_ids, drafts=greedy[:4], dists=own, seed=4, **kw),
                        timeout=TIMEOUT)
    assert (r.num_accepted, r.extra_token_id) == (4, greedy[4])


# --------------------------------------------------------------------------- drafter


def test_draft_greedy_equals_draft_models_generate(drafter, draft_model, prompt_ids):
    reply = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=4, max_support=8),
                          timeout=TIMEOUT)
    assert list(reply.token_ids) == hf_greedy(draft_model, prompt_ids, 4)
    assert len(reply.dists) == 4
    for token, d in zip(reply.token_ids, reply.dists, strict=True):
        assert list(d.token_ids) == [token]
        assert list(d.probs) == [1.0]
    assert reply.cached_len == len(prompt_ids) + 3
    assert not reply.cache_hit


def test_draft_delta_after_partial_acceptance(drafter, draft_model, prompt_ids):
    s = sid()
    r1 = drafter.Draft(dreq(s, [], prompt_ids, num_tokens=4), timeout=TIMEOUT)
    d = list(r1.token_ids)
    # The verifier accepted two drafts and chose its own token 42 after them.
    base = prompt_ids + d[:2]
    before = dstats(drafter)
    r2 = drafter.Draft(dreq(s, base, [42], num_tokens=3), timeout=TIMEOUT)
    after = dstats(drafter)
    assert r2.cache_hit
    assert list(r2.token_ids) == hf_greedy(draft_model, base + [42], 3)
    assert r2.cached_len == len(base) + 1 + 2
    assert after.fed_tokens - before.fed_tokens == 1
    assert after.draft_tokens - before.draft_tokens == 3
    # A wrong hash is refused with the resync marker and leaves the cache usable.
    expect_resync(drafter.Draft, drafter_pb2.DraftRequest(
        cache=delta(s, base + [42], [1], base_hash=token_hash(base + [42]) ^ 2), num_tokens=1,
        max_support=1))
    expect_resync(drafter.Draft, dreq(s, base + [42] + list(r2.token_ids), [1]))
    r3 = drafter.Draft(dreq(s, base + [42], [7], num_tokens=2), timeout=TIMEOUT)
    assert r3.cache_hit
    assert list(r3.token_ids) == hf_greedy(draft_model, base + [42, 7], 2)


def test_draft_sampled_dists_are_the_sparse_top_of_the_draft_model(drafter, draft_model,
                                                                   prompt_ids):
    reply = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=5, max_support=3,
                               temperature=1.0, top_k=5, seed=7), timeout=TIMEOUT)
    assert len(reply.token_ids) == len(reply.dists) == 5
    seq = list(prompt_ids)
    for token, d in zip(reply.token_ids, reply.dists, strict=True):
        ids, probs = list(d.token_ids), list(d.probs)
        assert 1 <= len(ids) <= 3 and len(ids) == len(probs)
        assert len(set(ids)) == len(ids)
        assert all(p > 0 for p in probs)
        assert abs(sum(probs) - 1.0) < 1e-4
        assert token in ids
        # q = the draft model's softmax restricted to its top 3 tokens, renormalised.
        top = torch.topk(hf_logits(draft_model, seq), 3)
        expected = dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(),
                            strict=True))
        assert set(ids) == set(expected)
        for i, p in zip(ids, probs, strict=True):
            assert p == pytest.approx(expected[i], abs=1e-4)
        seq.append(token)


def test_draft_seed_reproducibility(drafter, prompt_ids):
    def run(seed):
        r = drafter.Draft(dreq(sid(), [], prompt_ids, num_tokens=8, max_support=64,
                               temperature=1.5, seed=seed), timeout=TIMEOUT)
        return tuple(r.token_ids)

    assert run(99) == run(99)
    outcomes = {run(seed) for seed in range(1, 7)}
    assert len(outcomes) > 1, "different seeds should give different drafts"


# --------------------------------------------------------------------------- concurrency


def test_concurrent_verifies_on_one_session(verifier, target_model):
    """Two calls racing on one session: each either succeeds or is ABORTED (busy), and
    the cache then holds exactly one of the two prefixes, never a mix."""
    model = target_model[0]
    a = _long(400)
    b = [*a[:-1], a[-1] + 1]  # same length, different content
    for _ in range(3):
        s = sid()
        futures = [verifier.Verify.future(vreq(s, [], seq), timeout=TIMEOUT) for seq in (a, b)]
        for fut in futures:
            fut.exception()  # blocks until the call ends
        ok = {}
        for seq_name, seq, fut in (("a", a, futures[0]), ("b", b, futures[1])):
            code = fut.code()
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.ABORTED), (code, fut.details())
            if code == grpc.StatusCode.OK:
                r = fut.result()
                assert r.cached_len == len(seq)
                assert r.extra_token_id == hf_next(model, seq)
                ok[seq_name] = r
            else:
                assert "busy" in (fut.details() or "").lower()
        assert ok, "at least one of the calls must succeed"

        # Exactly one follow-up delta finds its prefix in the cache.
        followed = []
        for seq_name, seq in (("a", a), ("b", b)):
            extra = hf_next(model, seq)
            try:
                r = verifier.Verify(vreq(s, seq, [extra]), timeout=TIMEOUT)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
                continue
            assert r.cache_hit
            assert r.extra_token_id == hf_next(model, seq + [extra])
            assert r.cached_len == len(seq) + 1
            followed.append(seq_name)
        assert len(followed) == 1, followed
        assert followed[0] in ok
        verifier.Release(common_pb2.ReleaseRequest(session_id=s), timeout=TIMEOUT)
