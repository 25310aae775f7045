"""Rounds without drafts that ask the verifier for several tokens (--plain-tokens,
VerifyRequest.max_tokens): the tokens are the target's own, one after another; the caches
and cursors stay exact; the step and the cost model account for them.

In process: the round harness (tests/round_harness.py, references from its tables alone)
and the real tiny target against HF ``generate``; the mesh's processes in test_mesh.py."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from gateway.draft_length import DraftLength
from gateway.replicas import fit_verify_step
from gateway.round_result import RoundResult
from gateway.session_rounds import SessionRounds
from services.config import GatewayConfig, ServerConfig
from services.errors import InvalidArgument
from services.hashing import token_hash
from services.kv_cache import SessionCaches
from services.messages import CacheDelta, VerifyCall
from services.model_runner import ModelRunner
from services.models import describe
from services.params import SamplingParams
from services.session_store import SessionHandle
from specmesh.v1 import common_pb2, verifier_pb2
from tests.conftest import hf_greedy
from tests.round_harness import Harness, greedy_chain, tables
from verifier_svc.engine import VerifierEngine

PROMPT = [3, 17, 5, 42, 9]
GREEDY = SamplingParams()


def _call(session: str, prefix, base: int = 0, drafts=(), params=GREEDY, seed: int = 1,
          max_tokens: int = 1, logprobs: int = -1) -> VerifyCall:
    return VerifyCall(cache=CacheDelta(session_id=session, base_len=base,
                                       base_hash=token_hash(list(prefix[:base])),
                                       new_tokens=tuple(prefix[base:])),
                      draft_ids=tuple(drafts), q_ids=(), q_probs=(), params=params, seed=seed,
                      logprobs=logprobs, max_tokens=max_tokens)


@pytest.mark.parametrize("tokens", [2, 4, 7])
def test_plain_rounds_give_the_targets_greedy_chain_and_keep_the_cursors_exact(tokens):
    """k = 0 with several tokens a round: the target's own chain, ``tokens`` per round, and
    after each round the verifier holds every committed token but the last (no resync, one
    prefill)."""
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft)
    per_round = []

    def check(before, committed_before, r, h):
        per_round.append(len(r.proposed))
        entry = harness.verifier.caches._entries["s1"]
        assert h.verifier.length == len(h.tokens) - 1
        assert entry.tokens == h.tokens[:-1]
        assert entry.kv.get_seq_length() == len(entry.tokens)

    h, rounds = asyncio.run(harness.generate(PROMPT, 30, GREEDY, k=0, tokens=tokens,
                                             on_round=check))
    assert h.tokens[len(PROMPT):][:30] == greedy_chain(target, PROMPT, 30)
    assert per_round == [tokens] * len(rounds)
    assert all(not r.drafted and r.num_accepted == 0 for r in rounds)
    assert harness.verifier.caches.resyncs_requested == 0
    assert harness.verifier.caches.fresh_prefills == 1
    assert harness.stub("verifier").calls["Verify"] == math.ceil(30 / tokens)


def test_a_plain_round_stops_after_an_end_of_sequence_token():
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    chain = greedy_chain(target, PROMPT, 8)
    eos = chain[2]
    assert eos not in chain[:2]
    harness = Harness(target, draft)
    runner = harness.verifier.runner
    runner.meta = dataclasses.replace(runner.meta, eos_token_ids=(eos,))
    result = asyncio.run(harness.verifier.verify(_call("s", PROMPT, max_tokens=6)))
    assert [result.extra_token, *result.more] == chain[:3]
    assert result.cached_len == len(PROMPT) + 2
    assert runner.stats.forward_passes == 3


def test_sampled_plain_tokens_follow_the_targets_joint_distribution():
    """Temperature 1, two tokens a call, 4,000 seeds: the pairs (t1, t2) are distributed as
    p(t1 | prompt) p(t2 | prompt, t1), computed from the tables; total variation under
    0.06 (about 0.03 expected from sampling alone at this count; sampling t2 from the
    wrong context moves it by far more)."""
    vocab = 6
    target, draft = tables(vocab=vocab, seed=5, noise=1.0)
    target.a /= 3  # flatter rows: every pair has a real chance
    harness = Harness(target, draft)
    params = SamplingParams(temperature=1.0)
    prompt, n = [3, 1, 5, 2, 4], 4000

    async def draw():
        calls = [_call(f"s{i}", prompt, params=params, seed=i, max_tokens=2) for i in range(n)]
        out = []
        for start in range(0, n, 32):  # (the engine's queue holds 64 calls)
            out += await harness.verifier.verify_many(calls[start:start + 32])
        return out

    results = asyncio.run(draw())
    counts = collections.Counter((r.extra_token, r.more[0]) for r in results)
    last, before = prompt[-1], prompt[-2]
    p1 = torch.softmax(target.a[last] + target.b[before], -1)
    tvd = 0.0
    for t1 in range(vocab):
        p2 = torch.softmax(target.a[t1] + target.b[last], -1)
        for t2 in range(vocab):
            tvd += abs(counts[(t1, t2)] / n - float(p1[t1] * p2[t2]))
    assert tvd / 2 < 0.06


def test_bad_max_tokens_are_refused_with_what_to_fix():
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft)
    engine = harness.verifier
    with pytest.raises(InvalidArgument, match="max_tokens must be in 0..64"):
        asyncio.run(engine.verify(_call("a", PROMPT, max_tokens=65)))
    with pytest.raises(InvalidArgument, match="needs a call without drafts"):
        asyncio.run(engine.verify(_call("b", PROMPT, drafts=(4, 5), max_tokens=2)))
    runner = engine.runner
    runner.meta = dataclasses.replace(runner.meta, max_context=len(PROMPT) + 3)
    with pytest.raises(InvalidArgument, match="exceeds the model's context"):
        asyncio.run(engine.verify(_call("c", PROMPT, max_tokens=5)))
    ok = asyncio.run(engine.verify(_call("d", PROMPT, max_tokens=4)))  # fills it exactly
    assert len(ok.more) == 3 and ok.cached_len == len(PROMPT) + 3
    assert len(engine.caches) == 1, "the refused calls left no session behind"


def test_the_real_target_decodes_hf_greedys_tokens_beside_other_calls(target_model, tiny_pair):
    """The tiny target (lean forward): a 6-token call shares its passes with a call that
    verifies drafts and a one-token call; its tokens and logprobs are HF greedy's, and the
    next call goes on from its cache."""
    model, tokenizer = target_model
    meta = describe(tiny_pair[0], model, tokenizer)
    runner = ModelRunner(model, meta, torch.device("cpu"), max_queue=64, max_batch=16)
    engine = VerifierEngine(runner, SessionCaches(64, runner.new_kv), max_draft_tokens=16)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 11, 5)]
    want = hf_greedy(model, prompts[0], 10)
    assert meta.eos_token_ids[0] not in want[:9]

    async def run():
        first = await engine.verify_many([
            _call("plain", prompts[0], max_tokens=6, logprobs=2),
            _call("drafts", prompts[1], drafts=(5, 6, 7)),
            _call("one", prompts[2])])
        passes = runner.stats.forward_passes
        r = first[0]
        done = [*prompts[0], r.extra_token, *r.more]
        again = await engine.verify(_call("plain", done, base=r.cached_len, max_tokens=3))
        return first, passes, again

    (plain, drafted, one), passes, again = asyncio.run(run())
    assert [plain.extra_token, *plain.more] == want[:6]
    assert plain.cached_len == len(prompts[0]) + 5
    assert passes == 6 and plain.batch_size == 3
    assert [lp.token_id for lp in plain.logprobs] == want[:6]
    assert all(lp.top_ids[0] == lp.token_id for lp in plain.logprobs)  # greedy: the argmax
    assert not drafted.more and not one.more
    assert one.extra_token == hf_greedy(model, prompts[2], 1)[0]
    assert again.cache_hit and [again.extra_token, *again.more] == want[6:9]


def _verify_pb(new_tokens, drafts=(), max_tokens=4) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(
        cache=common_pb2.CacheDelta(session_id="s", new_tokens=new_tokens),
        draft_token_ids=drafts, max_tokens=max_tokens)


def test_a_step_that_feeds_a_prompt_or_verifies_drafts_asks_every_call_for_one_token():
    plain = [_verify_pb([5]), _verify_pb([6], max_tokens=3)]
    fit_verify_step(plain)
    assert [r.max_tokens for r in plain] == [4, 3]  # all plain: each keeps its own
    for odd in (_verify_pb([7, 8, 9], max_tokens=0), _verify_pb([7], drafts=[3, 4], max_tokens=0)):
        step = [_verify_pb([5]), odd, _verify_pb([6], max_tokens=3)]
        fit_verify_step(step)
        assert [r.max_tokens for r in step] == [0, 0, 0]


def _round(k: int, more: tuple[int, ...], compute_ms: float) -> RoundResult:
    return RoundResult(drafted=tuple(range(5, 5 + k)), drafter_tail=None, num_accepted=0,
                       extra_token=1, draft_ms=0.0, verify_ms=compute_ms + 2.0,
                       draft_compute_ms=0.0, verify_compute_ms=compute_ms, more=more)


def test_the_cost_model_weighs_a_plain_round_per_token():
    """A round of 4 tokens without drafts that took 40 ms of passes counts as what one
    token costs (a 10 ms pass, a quarter of its cycle), not as a 40 ms round of one token:
    else k = 0 would look four times dearer than it is next to drafting. Its call's
    overhead stays one call's (drafting rounds read it per call)."""
    config = GatewayConfig(server=ServerConfig(port=1), redis_url="redis://unused",
                           verifiers=("v",), num_draft_tokens=0)
    limits = SimpleNamespace(max_context=1000, max_draft_tokens=8)
    k = DraftLength(config, limits, drafters=None, inflight=lambda: 1)
    handle = SessionHandle(session_id="s", version=0, tokens=[1] * 20)
    req = SimpleNamespace(handle=handle, rounds=SessionRounds(handle))
    k.learn(req, "model", _round(0, (2, 3, 4), 40.0))
    costs = k._costs("model", req)
    assert costs.verify_ms_base == pytest.approx(10.0)
    assert costs.rtt_ms == pytest.approx(2.0)  # the one call's overhead, as it was
    req.rounds.last = (0.0, _round(0, (2, 3, 4), 40.0))
    k.learn_cycle(req, "model", 0.048)
    assert costs.cycle_ms[0] == pytest.approx(12.0)


def test_a_plain_call_runs_its_passes_in_one_hand_off_to_the_model_thread():
    """The model thread runs a batch's passes one after another while none of its jobs is
    done and no call waits, not a trip through the event loop per pass (ModelRunner
    ._passes); it hands back as soon as one job is done, and the others go on. (A call that
    arrives meanwhile joins at the next pass: test_batching.py.)"""
    target, draft = tables(vocab=48, seed=3, noise=1.5)
    harness = Harness(target, draft)
    runner = harness.verifier.runner
    hand_offs = []
    passes = runner._passes
    runner._passes = lambda active: hand_offs.append(len(out := passes(active))) or out

    async def run():
        alone = await harness.verifier.verify(_call("a", PROMPT, max_tokens=6))
        both = await harness.verifier.verify_many([_call("b", PROMPT, max_tokens=6),
                                                   _call("c", [*PROMPT, 4], max_tokens=2)])
        return alone, *both

    alone, b, c = asyncio.run(run())
    assert hand_offs == [6, 2, 4]
    chain = greedy_chain(target, PROMPT, 6)
    assert [alone.extra_token, *alone.more] == chain == [b.extra_token, *b.more]
    assert [c.extra_token, *c.more] == greedy_chain(target, [*PROMPT, 4], 2)
    assert b.batch_size == c.batch_size == 2


def test_the_fed_tokens_counter_counts_the_plain_tokens_a_call_fed_itself():
    """specmesh.verifier.fed_tokens: a call's new tokens, and the tokens a plain call fed
    onto the cache itself (all it returned but the last), on Verify and VerifyBatch alike:
    else a plain round of 4 tokens would count one token in four."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.convert import verify_call_to_pb
    from services.metrics import ModelServiceMetrics
    from tests.round_harness import InProcessStub
    from verifier_svc.server import VerifierServicer

    target, draft = tables(vocab=48, seed=3, noise=1.5)
    engine = Harness(target, draft).verifier
    reader = InMemoryMetricReader()
    metrics = ModelServiceMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"),
                                  "verifier", queue_depth=lambda: 0, sessions=lambda: 0,
                                  kv_bytes=lambda: 0, kv_capacity_bytes=lambda: 0)
    stub = InProcessStub(VerifierServicer(engine, metrics))

    def fed() -> int:
        return sum(p.value for rm in reader.get_metrics_data().resource_metrics
                   for sm in rm.scope_metrics for m in sm.metrics
                   if m.name == "specmesh.verifier.fed_tokens" for p in m.data.data_points)

    asyncio.run(stub.Verify(verify_call_to_pb(_call("a", PROMPT, max_tokens=4))))
    assert fed() == len(PROMPT) + 3
    batch = verifier_pb2.VerifyBatchRequest(calls=[
        verifier_pb2.VerifyStreamRequest(id=i, call=verify_call_to_pb(c)) for i, c in enumerate(
            [_call("b", PROMPT, max_tokens=3), _call("c", PROMPT, max_tokens=1)])])
    asyncio.run(stub.VerifyBatch(batch))
    assert fed() == len(PROMPT) + 3 + (len(PROMPT) + 2) + len(PROMPT)
    assert engine.stats.fed_tokens == fed()  # GetStats says the same
