"""Decoding ahead (verifier_svc/decode_ahead.py, VerifyRequest.ahead): a plain call's next
round starts once it is answered; the session's next call takes it over when it asks for
exactly that round, and any other call stops it first. What every call returns is what it
returns without decoding ahead.

In process: the verifier engine on table models (expected tokens from the tables alone,
``greedy_chain``; sampled tokens from a second engine that never decodes ahead), and the
gateway's whole scheduler over them (tests/engine_harness.py, a real Redis). The mesh's
processes run with it on by default in every process-level test (test_mesh.py, ...)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from services.errors import InvalidArgument
from services.hashing import token_hash
from services.messages import CacheDelta, VerifyCall
from services.model_info import load_tokenizer
from services.params import SamplingParams
from tests.engine_harness import EngineHarness, spec, token_ids
from tests.round_harness import Harness, greedy_chain, tables

PROMPT = [3, 17, 5, 42, 9]
GREEDY = SamplingParams()


def _call(prefix, base: int = 0, drafts=(), params=GREEDY, seed: int = 1, max_tokens: int = 1,
          ahead: int = 0, ahead_seed: int = 0, logprobs: int = -1,
          session: str = "s") -> VerifyCall:
    return VerifyCall(cache=CacheDelta(session_id=session, base_len=base,
                                       base_hash=token_hash(list(prefix[:base])),
                                       new_tokens=tuple(prefix[base:])),
                      draft_ids=tuple(drafts), q_ids=(), q_probs=(), params=params, seed=seed,
                      logprobs=logprobs, max_tokens=max_tokens, ahead=ahead,
                      ahead_seed=ahead_seed)


def _engine(seed: int = 3):
    target, draft = tables(vocab=48, seed=seed, noise=1.5)
    return Harness(target, draft).verifier, target


def _tokens(result) -> list[int]:
    return [result.extra_token, *result.more]


async def _settled(engine, session: str = "s") -> None:
    """Waits until the session's decode-ahead job has run to its end (not taken)."""
    for _ in range(200):
        ahead = engine.ahead._jobs.get(session)
        if ahead is None or ahead.future.done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the decode-ahead job never finished")


@pytest.mark.parametrize("wait", [False, True], ids=["running", "done"])
def test_the_next_call_takes_the_round_decoded_ahead(wait):
    """Three plain rounds of 4 tokens, each asking for the next: the second and third are
    taken over (no new job), whether the job still runs or has finished, and the tokens are
    the target's chain; the cache holds every token but the last, as without it."""
    engine, target = _engine()
    chain = greedy_chain(target, PROMPT, 12)

    async def run():
        out, done = [], list(PROMPT)
        for _ in range(3):
            base = len(done) - 1 if out else 0
            r = await engine.verify(_call(done, base=base, max_tokens=4, ahead=4))
            out.append(r)
            done += _tokens(r)
            if wait:
                await _settled(engine)
        await engine.ahead.drop("s")  # the third round's job, which no call takes
        return out, done

    results, done = asyncio.run(run())
    assert [t for r in results for t in _tokens(r)] == chain
    assert [r.cached_len for r in results] == [len(PROMPT) + 3 + 4 * i for i in range(3)]
    assert engine.stats.ahead_started == 3 and engine.stats.ahead_taken == 2
    assert engine.caches.resyncs_requested == 0
    entry = engine.caches._entries["s"]
    assert entry.tokens[:len(done) - 1] == done[:-1]


def test_a_call_that_asks_for_fewer_tokens_gets_them_and_the_cache_is_trimmed():
    """The job decoded 6 tokens ahead; the next call asks for 2 (a step that verifies drafts
    asks every call for one, gateway/replicas.py fit_verify_step): it gets the chain's next 2,
    the cache is cropped to them, and the call after goes on from there exactly."""
    engine, target = _engine()
    chain = greedy_chain(target, PROMPT, 12)

    async def run():
        first = await engine.verify(_call(PROMPT, max_tokens=3, ahead=6, logprobs=1))
        await _settled(engine)
        done = [*PROMPT, *_tokens(first)]
        second = await engine.verify(_call(done, base=len(done) - 1, max_tokens=2, logprobs=1))
        done += _tokens(second)
        third = await engine.verify(_call(done, base=len(done) - 1, max_tokens=4))
        return first, second, third

    first, second, third = asyncio.run(run())
    assert _tokens(first) + _tokens(second) + _tokens(third) == chain[:9]
    assert engine.stats.ahead_taken == 1
    assert second.cached_len == len(PROMPT) + 3 + 2 - 1  # every committed token but the last
    assert [lp.token_id for lp in second.logprobs] == _tokens(second)
    assert third.cache_hit and engine.caches.resyncs_requested == 0


def test_a_call_for_something_else_stops_the_job_and_runs_as_it_would_without_it():
    """After a plain round that decoded 8 ahead, the next call verifies drafts instead: the
    job is stopped (not taken), and the call's answer and the cache after it are a fresh
    engine's for the same calls without decoding ahead."""
    chain_engine, target = _engine()
    chain = greedy_chain(target, PROMPT, 8)

    def calls(ahead: int):
        first = _call(PROMPT, max_tokens=2, ahead=ahead)
        done = [*PROMPT, *chain[:2]]
        drafts = (chain[2], chain[3], (chain[4] + 1) % 48)  # the third draft is wrong
        return first, _call(done, base=len(done) - 1, drafts=drafts)

    async def run(engine, ahead: int):
        first, second = calls(ahead)
        await engine.verify(first)
        result = await engine.verify(second)
        await engine.ahead.drop("s")
        return result, list(engine.caches._entries["s"].tokens)

    with_ahead, plain = _engine()[0], _engine()[0]
    got, cache = asyncio.run(run(with_ahead, 8))
    want, want_cache = asyncio.run(run(plain, 0))
    assert got == dataclasses.replace(want, compute_ms=got.compute_ms)
    assert (got.num_accepted, got.extra_token) == (2, chain[4])
    assert cache == want_cache
    assert with_ahead.stats.ahead_started == 1 and with_ahead.stats.ahead_taken == 0
    assert with_ahead.caches.resyncs_requested == 0


def test_a_sampled_round_decoded_ahead_draws_what_its_seed_draws():
    """Temperature 1: the round taken over draws exactly what a call with the ahead seed
    draws on an engine that never decodes ahead (the same job, the same generator), and a
    call with another seed is not served by it."""
    params = SamplingParams(temperature=1.0)

    async def run(engine, ahead: int, second_seed: int):
        first = await engine.verify(_call(PROMPT, params=params, seed=11, max_tokens=3,
                                          ahead=ahead, ahead_seed=99))
        done = [*PROMPT, *_tokens(first)]
        second = await engine.verify(_call(done, base=len(done) - 1, params=params,
                                           seed=second_seed, max_tokens=3))
        return _tokens(first) + _tokens(second)

    engine, _ = _engine()
    assert asyncio.run(run(engine, 3, 99)) == asyncio.run(run(_engine()[0], 0, 99))
    assert engine.stats.ahead_taken == 1
    other, _ = _engine()
    assert asyncio.run(run(other, 3, 5)) == asyncio.run(run(_engine()[0], 0, 5))
    assert other.stats.ahead_started == 1 and other.stats.ahead_taken == 0


def test_release_stops_the_job_and_frees_the_session():
    engine, _ = _engine()

    async def run():
        await engine.verify(_call(PROMPT, max_tokens=2, ahead=8))
        assert "s" in engine.ahead
        released = await engine.release("s")
        return released

    assert asyncio.run(run()) is True
    assert "s" not in engine.ahead and "s" not in engine.caches
    assert not engine.caches._busy


def test_a_job_no_call_takes_expires_and_puts_the_cache_back_at_rest():
    """A gateway that went away: after the TTL the job is stopped and the session's cache is
    at rest again (not busy), holding the uncommitted tokens it decoded, which a later call
    from the committed prefix crops."""
    engine, target = _engine()
    engine.ahead.ttl_s = 0.05
    chain = greedy_chain(target, PROMPT, 6)

    async def run():
        first = await engine.verify(_call(PROMPT, max_tokens=2, ahead=4))
        await asyncio.sleep(0.3)
        expired = "s" not in engine.ahead and not engine.caches._busy
        held = len(engine.caches._entries["s"].tokens)
        done = [*PROMPT, *_tokens(first)]
        again = await engine.verify(_call(done, base=len(done) - 1, max_tokens=4, seed=2))
        return expired, held, _tokens(first) + _tokens(again)

    expired, held, tokens = asyncio.run(run())
    assert expired and held > len(PROMPT) + 1  # it decoded past the committed tokens
    assert tokens == chain
    assert engine.stats.ahead_taken == 0 and engine.caches.resyncs_requested == 0


def test_no_job_starts_after_an_end_of_sequence_token_or_past_the_context():
    engine, target = _engine()
    chain = greedy_chain(target, PROMPT, 4)
    runner = engine.runner
    runner.meta = dataclasses.replace(runner.meta, eos_token_ids=(chain[1],))
    result = asyncio.run(engine.verify(_call(PROMPT, max_tokens=4, ahead=4)))
    assert _tokens(result) == chain[:2] and "s" not in engine.ahead
    full, _ = _engine()
    full.runner.meta = dataclasses.replace(full.runner.meta, max_context=len(PROMPT) + 3)
    result = asyncio.run(full.verify(_call(PROMPT, max_tokens=3, ahead=4)))
    assert len(_tokens(result)) == 3 and "s" not in full.ahead
    assert full.stats.ahead_started == 0


def test_a_bad_ahead_is_refused_with_what_to_fix_and_stops_nothing_else():
    engine, _ = _engine()
    with pytest.raises(InvalidArgument, match="ahead must be in 0..64, got 65"):
        asyncio.run(engine.verify(_call(PROMPT, max_tokens=2, ahead=65, session="a")))
    with pytest.raises(InvalidArgument, match="needs a call without drafts"):
        asyncio.run(engine.verify(_call(PROMPT, drafts=(4, 5), ahead=2, session="b")))
    assert len(engine.caches) == 0 and engine.stats.ahead_started == 0


VOCAB = 512  # the tiny pair's tokenizer's
PROMPTS = [[(7 * i + 3 * j + 1) % VOCAB for j in range(4 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return load_tokenizer(tiny_pair[0])


@pytest.mark.parametrize("decode_ahead", [True, False], ids=["on", "off"])
def test_the_gateway_asks_for_the_next_round_and_outputs_stay_the_targets(
        redis_url, tokenizer, decode_ahead):
    """Six target-only requests at once and one that may draft, through the gateway's
    scheduler with step batching and Redis commits: each output is the target's chain; with
    decode-ahead on the verifier takes most plain rounds over from jobs it started (each
    request's first round asks for one token, its last for nothing after it), off it
    starts none."""
    target, draft = tables(vocab=VOCAB, seed=5, noise=1.0)

    async def main():
        h = EngineHarness(target, draft, redis_url, tokenizer, decode_ahead=decode_ahead)
        try:
            outs = await asyncio.gather(*(
                h.complete(spec(p, 40, speculate=i == 0)) for i, p in enumerate(PROMPTS)))
            return h, outs
        finally:
            await h.close()

    h, outs = asyncio.run(main())
    for p, chunks in zip(PROMPTS, outs, strict=True):
        assert token_ids(chunks) == greedy_chain(target, p, 40)
    stats = h.verifier.stats
    plain_rounds = sum(chunks[-1].usage.rounds for chunks in outs[1:])
    if decode_ahead:
        assert stats.ahead_taken >= plain_rounds - 2 * len(PROMPTS[1:])
        assert stats.ahead_taken > 0
    else:
        assert stats.ahead_started == 0
    assert not h.verifier.ahead._jobs, "no job is left once every request ended"


def test_a_seeded_sample_takes_its_rounds_over_and_draws_what_it_draws_without(
        redis_url, tokenizer):
    """Temperature 1 with a seed, target-only, through the gateway's scheduler: each round
    names the next round's seed, so the verifier's jobs are taken over (a wrong seed would
    leave every one of them unused), and the output is the one the same request draws with
    decode-ahead off."""
    target, draft = tables(vocab=VOCAB, seed=5, noise=1.0)
    request = spec(PROMPTS[2], 24, speculate=False, seed=1234,
                   params=SamplingParams(temperature=1.0))

    async def main(decode_ahead: bool):
        h = EngineHarness(target, draft, redis_url, tokenizer, decode_ahead=decode_ahead)
        try:
            return h, token_ids(await h.complete(request))
        finally:
            await h.close()

    on, drawn = asyncio.run(main(True))
    _, want = asyncio.run(main(False))
    assert drawn == want
    assert on.verifier.stats.ahead_taken >= 24 - 2  # a token a round: all but the first two
