"""The gateway's choice of k per round (gateway/draft_length.py), driven the way the round
loop drives it (choose, then learn the round, then the cycle at the next round's start),
with round times and acceptance from a fixed-seed simulation: no replica is called (the
pool's one drafter has no channel)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from gateway.chunks import TargetLimits
from gateway.draft_length import DraftLength
from gateway.replicas import Replica, ReplicaPool
from gateway.requests import GenerationSpec
from gateway.rounds import RoundResult
from services.config import GatewayConfig, ServerConfig
from services.params import SamplingParams
from services.session_store import SessionHandle

GREEDY = GenerationSpec(prompt="", prompt_ids=(), params=SamplingParams(), max_new_tokens=4096,
                        stop=(), seed=None, num_draft_tokens=0, speculate=True,
                        drafter_kind="model", session_id="", keep_session=False)


@dataclass
class _Req:
    """The fields of the engine's per-request state that DraftLength reads and writes."""

    spec: GenerationSpec
    handle: SessionHandle
    generated: int = 0
    adaptive: object = None
    last_round: tuple[float, RoundResult] | None = None


def _run(spec: GenerationSpec, alpha: float, cycle_ms, rounds: int = 200, context: int = 900,
         **config) -> list[int]:
    """k of each of ``rounds`` rounds of one request whose drafts are accepted per token at
    ``alpha`` and whose round with k drafts takes ``cycle_ms(k)`` from start to next start."""
    cfg = GatewayConfig(server=ServerConfig(port=1), redis_url="redis://x",
                        verifiers=("127.0.0.1:2",), **config)
    pool = ReplicaPool("drafter", (), 1.0, [])
    pool.replicas["drafter"] = Replica("drafter", None, None)  # never called
    limits = TargetLimits(vocab_size=100, max_context=1 << 20, eos_token_ids=frozenset(),
                          fingerprint="f", max_draft_tokens=8)
    dl = DraftLength(cfg, limits, pool, inflight=lambda: 1)
    req = _Req(spec, SessionHandle(session_id="s", version=0, tokens=[5] * context))
    rng, now, ks = random.Random(7), 0.0, []
    for _ in range(rounds):
        dl.learn_cycle(req, "model", now)
        k = dl.choose(req, "model")
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        r = RoundResult(drafted=(9,) * k, drafter_tail=(9,) * k, num_accepted=accepted,
                        extra_token=3, draft_ms=1.0 if k else 0.0, verify_ms=8.0,
                        draft_compute_ms=0.5 if k else 0.0, verify_compute_ms=7.0)
        dl.learn(req, "model", r)
        req.last_round = (now, r)
        now += cycle_ms(k) / 1000.0
        ks.append(k)
    return ks


def bad(k):  # a drafter past its training length behind an 800-token context
    return 14.5 + 3.5 * k


def test_the_gateway_k_falls_back_to_none_while_drafts_do_not_pay():
    """Acceptance 0.15, a round with 3 drafts 25 ms against 14.5 without: 1.18 tokens per
    25 ms is less than 1 per 14.5, so after learning, only the probes draft."""
    ks = _run(GREEDY, 0.15, bad)
    tail = ks[-64:]
    assert tail.count(0) >= 52 and set(tail) <= {0, 3}, tail


def test_the_gateway_k_stays_while_drafts_pay():
    """Acceptance 0.8, 3 drafts 14.5 ms against 10: 2.95 tokens per 14.5 ms; one round in
    32 checks that not drafting is still dearer."""
    ks = _run(GREEDY, 0.8, lambda k: 10.0 + 1.5 * k)
    tail = ks[-64:]
    assert tail.count(3) >= 60 and set(tail) <= {0, 3}, tail


def test_a_k_the_request_set_seeded_sampling_and_no_fallback_keep_the_k():
    own = _run(replace(GREEDY, num_draft_tokens=3), 0.15, bad)
    assert own == [3] * len(own)  # the request's own k: never changed
    seeded = replace(GREEDY, seed=1, params=SamplingParams(temperature=0.8))
    assert set(_run(seeded, 0.15, bad)) == {3}  # same k every run, so the same sample
    assert set(_run(GREEDY, 0.15, bad, spec_fallback=False)) == {3}
